"""The fused attention path (slimfit/autograd/fused_attention.py) and its routing.

Reference: PyTorch's own scaled_dot_product_attention (its CPU fused kernel, or the math
backend where said). Error bound of the 8-bit format, and why:

* The default backward ('recompute') reruns the fused forward on the dequantized Q̃, K̃, Ṽ, so
  its gradient is *exactly* the gradient of attention at (Q̃, K̃, Ṽ): tested to fp32 rounding
  (`test_recompute_is_the_exact_gradient_at_the_dequantized_point`). That pins the whole error
  on the storage format.
* Against the exact gradient at (Q, K, V): per-group 8-bit min/max storage has a relative RMS
  error e ≈ 0.6% per tensor (step = range/255, error step/√12). A gradient feels these
  errors directly (coefficient ~1) and through P, where the logit error grows with the logit
  spread σ (softmax is steeper for peaked rows). The test asserts
  rel(dX) ≤ (1 + σ/2)·√(e_Q² + e_K² + e_V²), with the e's measured on the same tensors
  (measured ratios rel/√Σe²: 0.84-1.08 at σ ≤ 1, 1.8 at σ = 3, 2.65 at σ = 5).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from slimfit.autograd.attention import attention
from slimfit.autograd.fused_attention import BACKWARD_MODES, fused_attention, fused_kernel, quantized_bytes
from slimfit.kernels import dequantize, quantize
from slimfit.memory import saved_bytes


def make_qkv(b=2, hq=4, hk=2, sq=64, sk=None, d=32, logit_std=3.0, seed=0, dtype=torch.float32):
    """Q, K with q·k/√d of std `logit_std`, V ~ N(0, 1); K/V with hk heads."""
    g = torch.Generator().manual_seed(seed)
    sk = sq if sk is None else sk
    s = math.sqrt(logit_std)
    q = torch.randn(b, hq, sq, d, generator=g) * s
    k = torch.randn(b, hk, sk, d, generator=g) * s
    v = torch.randn(b, hk, sk, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def sdpa(q, k, v, **kw):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kw)


def run(fn, q, k, v, **kw):
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(qq, kk, vv, **kw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(g)
    return out.detach(), (qq.grad, kk.grad, vv.grad)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def qerr(x, bits=8, group_size=128):
    return rel(dequantize(quantize(x, bits, group_size)), x)


def key_padding(b, sk, lengths, kind):
    keep = torch.arange(sk)[None, :] < torch.tensor(lengths)[:, None]  # (b, sk)
    keep = keep[:, None, None, :]
    if kind == "bool":
        return keep
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)


# ------------------------------------------------------------------ exactness without compression

@pytest.mark.parametrize("kw", [
    dict(), dict(is_causal=True), dict(mask="bool"), dict(mask="float"), dict(scale=0.3),
])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("mode", BACKWARD_MODES)
def test_uncompressed_equals_sdpa_bit_for_bit(kw, heads, mode):
    """qkv_bits=None: forward and gradients are PyTorch's fused SDPA, bit for bit."""
    q, k, v = make_qkv(hq=heads[0], hk=heads[1], sq=37, d=16)
    kw = dict(kw)
    if "mask" in kw:
        kw["attn_mask"] = key_padding(2, 37, [37, 20], kw.pop("mask"))
    out, grads = run(fused_attention, q, k, v, qkv_bits=None, backward=mode, **kw)
    ref, rgrads = run(sdpa, q, k, v, **kw)
    assert torch.equal(out, ref)
    for g, r in zip(grads, rgrads):
        assert g.shape == r.shape
        assert torch.equal(g, r)


def test_forward_is_exact_with_8bit_saving():
    q, k, v = make_qkv(sq=50)
    out, _ = run(fused_attention, q, k, v, is_causal=True)
    ref, _ = run(sdpa, q, k, v, is_causal=True)
    assert torch.equal(out, ref)


# ------------------------------------------------------------------ 8-bit gradients

@pytest.mark.parametrize("causal", [False, True])
def test_recompute_is_the_exact_gradient_at_the_dequantized_point(causal):
    q, k, v = make_qkv(sq=70, d=64)
    deq = [dequantize(quantize(t, 8, 128)) for t in (q, k, v)]
    _, grads = run(fused_attention, q, k, v, is_causal=causal)
    _, at_deq = run(sdpa, *deq, is_causal=causal)
    for g, r in zip(grads, at_deq):
        assert rel(g, r) < 1e-6


def test_transposed_views_quantized_in_memory_order_without_a_copy():
    """BERT / ViT hand attention (B, S, H, D).transpose(1, 2) views of their projections: the fused
    path quantizes them as they lie in memory (no contiguous copy in forward), and its gradient is
    still exactly the gradient at the dequantized point."""
    g = torch.Generator().manual_seed(5)
    base = [torch.randn(2, 70, 4, 64, generator=g) for _ in range(3)]   # (B, S, H, D)
    leaves = [t.requires_grad_() for t in base]
    q, k, v = (t.transpose(1, 2) for t in leaves)                       # (B, H, S, D) views

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.clone.default, torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Copies() as mode:
        out = fused_attention(q, k, v)
    assert mode.seen == []
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))   # as run() does
    deq = [dequantize(quantize(t.detach(), 8, 128)).transpose(1, 2) for t in base]   # groups in memory order
    _, at_deq = run(sdpa, *deq)
    for leaf, r in zip(leaves, at_deq):
        assert rel(leaf.grad.transpose(1, 2), r) < 1e-6


@pytest.mark.parametrize("logit_std", [1.0, 3.0, 5.0])
@pytest.mark.parametrize("shape", [dict(hq=4, hk=4, sq=128, d=64), dict(hq=8, hk=2, sq=200, d=32)])
def test_8bit_gradient_error_bounded_by_the_format(logit_std, shape):
    q, k, v = make_qkv(logit_std=logit_std, **shape)
    e = math.sqrt(qerr(q) ** 2 + qerr(k) ** 2 + qerr(v) ** 2)
    _, grads = run(fused_attention, q, k, v, is_causal=True)
    _, exact = run(sdpa, q, k, v, is_causal=True)
    for name, g, r in zip("QKV", grads, exact):
        assert rel(g, r) <= (1 + logit_std / 2) * e, name


def test_recompute_is_more_accurate_than_saved_lse():
    """The choice of the default: 'saved' mixes the exact lse/O with the dequantized Q/K."""
    q, k, v = make_qkv(hq=8, hk=2, sq=256, d=64, logit_std=3.0)
    _, exact = run(sdpa, q, k, v, is_causal=True)
    errs = {}
    for mode in BACKWARD_MODES:
        _, grads = run(fused_attention, q, k, v, is_causal=True, backward=mode)
        errs[mode] = sum(rel(g, r) for g, r in zip(grads, exact))
    assert errs["recompute"] < errs["saved"]


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_padding_mask_grads(kind):
    q, k, v = make_qkv(sq=48)
    mask = key_padding(2, 48, [48, 17], kind)
    deq = [dequantize(quantize(t, 8, 128)) for t in (q, k, v)]
    out, grads = run(fused_attention, q, k, v, attn_mask=mask)
    ref, _ = run(sdpa, q, k, v, attn_mask=mask)
    _, at_deq = run(sdpa, *deq, attn_mask=mask)
    assert torch.equal(out, ref)
    for g, r in zip(grads, at_deq):
        assert rel(g, r) < 1e-6
    # masked keys get no gradient
    assert grads[1][1, :, 17:].abs().max() == 0 and grads[2][1, :, 17:].abs().max() == 0


def test_fully_masked_rows_give_zeros_not_nan():
    q, k, v = make_qkv(sq=16)
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    mask[0, :, 3] = False  # query row 3 of batch 0 sees nothing
    out, grads = run(fused_attention, q, k, v, attn_mask=mask)
    assert torch.isfinite(out).all() and out[0, :, 3].abs().max() == 0
    assert all(torch.isfinite(g).all() for g in grads)
    assert grads[0][0, :, 3].abs().max() == 0


def test_bf16_inputs():
    q, k, v = make_qkv(sq=40, dtype=torch.bfloat16)
    out, grads = run(fused_attention, q, k, v, is_causal=True)
    ref, exact = run(sdpa, q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    for g, r in zip(grads, exact):
        assert g.dtype == torch.bfloat16
        assert rel(g, r) < 3e-2  # bf16's own rounding (2^-8) plus the 8-bit format


# ------------------------------------------------------------------ bytes saved

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qkv_bits", [None, 8, 4])
@pytest.mark.parametrize("mode", BACKWARD_MODES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_saved_bytes_match_format(dtype, qkv_bits, mode, heads):
    b, (hq, hk), s, d, gs = 2, heads, 30, 16, 64
    q, k, v = (t.requires_grad_() for t in make_qkv(b=b, hq=hq, hk=hk, sq=s, d=d, dtype=dtype))
    mask = key_padding(b, s, [30, 11], "bool")
    esz = torch.empty((), dtype=dtype).element_size()
    n_q, n_kv = b * hq * s * d, b * hk * s * d  # K/V at their own head count: never expanded
    if qkv_bits is None:
        expect = (n_q + 2 * n_kv) * esz
    else:
        expect = quantized_bytes(n_q, qkv_bits, gs) + 2 * quantized_bytes(n_kv, qkv_bits, gs)
    expect += mask.numel()  # the mask as given (bool: 1 byte per element), shared by all layers of a model
    if mode == "saved":
        expect += n_q * esz + b * hq * s * 4  # O in the input dtype + fp32 logsumexp
    got = saved_bytes(lambda: fused_attention(q, k, v, attn_mask=mask, qkv_bits=qkv_bits, group_size=gs,
                                              backward=mode))
    assert got == expect


def test_gqa_saves_less_than_expanded():
    q, k, v = (t.requires_grad_() for t in make_qkv(hq=8, hk=2, sq=64, d=32))
    gqa = saved_bytes(lambda: fused_attention(q, k, v, is_causal=True))
    k4, v4 = (t.detach().repeat_interleave(4, 1).requires_grad_() for t in (k, v))
    expanded = saved_bytes(lambda: fused_attention(q, k4, v4, is_causal=True))
    assert gqa == quantized_bytes(q.numel(), 8, 128) + 2 * quantized_bytes(k.numel(), 8, 128)
    assert gqa * 2 == expanded  # 8 + 2 + 2 head-sized tensors instead of 8 + 8 + 8


# ------------------------------------------------------------------ nothing of size S×S

class LargeAllocations(TorchDispatchMode):
    """Records every op output whose storage holds at least `limit` elements."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.seen: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= self.limit * t.element_size():
                self.seen.append((str(func), tuple(t.shape)))
        return out


def _step(fn, q, k, v, **kw):
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    fn(qq, kk, vv, **kw).sum().backward()


@pytest.mark.parametrize("mask", [None, "key_padding"])
def test_no_s_by_s_tensor_in_a_training_step_at_seq_1024(mask):
    s = 1024
    q, k, v = make_qkv(b=1, hq=4, hk=2, sq=s, d=32)
    kw = {"is_causal": True} if mask is None else {"attn_mask": key_padding(1, s, [900], "bool")}
    with LargeAllocations(s * s) as rec:
        _step(fused_attention, q, k, v, **kw)
    assert rec.seen == []
    # the detector does see the materializing path's B·H·S·S scores
    with LargeAllocations(s * s) as rec:
        _step(attention, q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), probs="int8", **kw)
    assert rec.seen


# ------------------------------------------------------------------ which kernel / fallbacks

def test_fused_kernel_choices_on_cpu():
    q, k, v = make_qkv()
    assert fused_kernel(q, k, v, None, 0.0, True) == "cpu_flash"
    assert fused_kernel(q, k, v, None, 0.1, False) is None  # the CPU op refuses dropout
    grad_mask = torch.zeros(64, 64, requires_grad=True)
    assert fused_kernel(q, k, v, grad_mask, 0.0, False) is None  # no mask gradient from the fused op
    assert fused_kernel(q[0], k[0], v[0], None, 0.0, False) is None  # not (B, H, S, D)
    assert fused_kernel(q, k[:, :1].expand(2, 3, 64, 32), v[:, :1].expand(2, 3, 64, 32), None, 0.0, False) is None


def test_dropout_on_cpu_raises_with_the_fix():
    q, k, v = (t.requires_grad_() for t in make_qkv())
    with pytest.raises(ValueError, match="slimfit.autograd.attention"):
        fused_attention(q, k, v, dropout_p=0.1)
    fused_attention(q, k, v, dropout_p=0.1, training=False)  # eval: no dropout, fused


def test_bad_arguments():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="backward"):
        fused_attention(q, k, v, backward="maybe")
    with pytest.raises(ValueError, match="multiple"):
        fused_attention(q, k[:, :1].expand(2, 3, 64, 32), v[:, :1].expand(2, 3, 64, 32))
    with pytest.raises(ValueError, match="not both"):
        fused_attention(q, k, v, attn_mask=torch.ones(64, 64, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="group_size"):
        fused_attention(q, k, v, group_size=100)
    # named as what they are, not as "no fused kernel takes these inputs ... use attention"
    with pytest.raises(TypeError, match="mismatched dtypes .*cast them to one dtype"):
        fused_attention(q, k.half(), v)
    with pytest.raises(ValueError, match="different devices .*k on meta.*move them to one device"):
        fused_attention(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="does not broadcast to the score shape"):
        fused_attention(q, k, v, attn_mask=torch.ones(3, 64, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        fused_attention(q, k, v, attn_mask=torch.ones(64, 64, dtype=torch.int64))


def test_double_backward_raises():
    q, k, v = (t.requires_grad_() for t in make_qkv(sq=8))
    out = fused_attention(q, k, v)
    (gq,) = torch.autograd.grad(out.sum(), q, create_graph=False)
    out = fused_attention(q, k, v)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    assert torch.isfinite(gq).all()


def test_autocast_bf16():
    q, k, v = (t.requires_grad_() for t in make_qkv(sq=32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_attention(q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()


def test_no_grad_saves_nothing_and_matches():
    q, k, v = make_qkv(sq=20)
    with torch.no_grad():
        out = fused_attention(q, k, v, is_causal=True)
    assert torch.equal(out, sdpa(q, k, v, is_causal=True))



# ------------------------------------------------------------------ CUDA helpers (the CUDA branch cannot run here)

def test_efficient_bias_is_aligned_views_of_the_mask():
    from slimfit.autograd.fused_attention import _additive_mask, _efficient_bias

    q, k, _ = make_qkv(b=2, hq=4, hk=4, sq=37)
    mask = _additive_mask(key_padding(2, 37, [37, 20], "bool").expand(2, 1, 37, 37).contiguous(), torch.float32)
    bias = _efficient_bias(mask, q, k)
    assert bias.shape == (2, 4, 37, 37)
    assert all(bias.stride(i) % 8 == 0 for i in range(3)) and bias.stride(-1) == 1
    assert torch.equal(bias, mask.expand(2, 4, 37, 37))


def test_expand_and_reduce_kv_groups():
    from slimfit.autograd.fused_attention import _expand_kv, _reduce_groups

    k = torch.randn(2, 2, 5, 8)
    e = _expand_kv(k, 6)
    assert torch.equal(e, k.repeat_interleave(3, 1))  # query head j reads kv head j // 3
    assert torch.allclose(_reduce_groups(e, 2), 3 * k)
    assert _reduce_groups(k, 2) is k


@pytest.mark.parametrize("backward", BACKWARD_MODES)
@pytest.mark.parametrize("into", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("mask", [None, "bool", "causal"])
def test_nonfinite_reaches_every_gradient(backward, into, value, mask):
    """Guard (issue #30): wherever SDPA's fused gradients are NaN/Inf, slimfit's are too (a non-finite
    group of the 8-bit Q/K/V dequantizes to non-finite values, which the fused backward propagates)."""
    q, k, v = make_qkv(b=1, hq=2, hk=1, sq=16, d=16)
    {"q": q, "k": k, "v": v}[into][0, 0, 5, 3] = value
    kw = {"is_causal": True} if mask == "causal" else {}
    if mask == "bool":
        kw["attn_mask"] = torch.rand(16, 16, generator=torch.Generator().manual_seed(2)) > 0.3
        kw["attn_mask"][:, 0] = True
    _, ref = run(sdpa, q, k, v, **kw)
    _, got = run(lambda *a, **m: fused_attention(*a, backward=backward, **m), q, k, v, **kw)
    for a, r in zip(got, ref):
        assert not ((~torch.isfinite(r)) & torch.isfinite(a)).any()
