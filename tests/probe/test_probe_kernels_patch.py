"""Probe of the public kernels, autograd functions, patch/unpatch and memory with bad and extreme
input. Every case either gives the right answer (checked against a reference) or raises an error
whose message names the argument: nothing silently wrong, nothing unclear.

Each case is (id, call, expect): expect is a callable checking the result, or an
(exception type, regex the message must match) pair.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimfit
from slimfit import SlimFitConfig, memory
from slimfit import autograd as sf
from slimfit.autograd.sampled_linear import sampled_linear
from slimfit.kernels import (
    PrunedTensor,
    dequantize,
    dropout_mask,
    pack_bits,
    quantize,
    seeded_dropout,
    topk_prune,
    topk_restore,
    unpack_bits,
)

NAN, INF = float("nan"), float("inf")
# The C++ kernels raise RuntimeError (TORCH_CHECK), the Python backends ValueError / TypeError; the
# message is the same either way.
_NATIVE_OR_PY = (RuntimeError, ValueError, TypeError)


def _x(*shape, dtype=torch.float32, fill=None):
    g = torch.Generator().manual_seed(sum(shape) + 1)
    x = torch.randn(*shape, generator=g).to(dtype)
    if fill is not None:
        x.view(-1)[0] = fill
    return x


def _roundtrip_ok(x, bits, group_size=32):
    """Dequantized within half a step of each group (the format's promise)."""
    def check(q):
        d = dequantize(q, torch.float32).reshape(-1)
        flat = x.float().reshape(-1)
        if flat.numel() == 0:
            return d.numel() == 0
        n = flat.numel()
        pad = (-n) % group_size
        groups = torch.cat([flat, flat[-1:].expand(pad)]).view(-1, group_size)
        step = ((groups.amax(1) - groups.amin(1)) / (2 ** bits - 1)).repeat_interleave(group_size)[:n]
        return bool(((d - flat).abs() <= step / 2 * (1 + 1e-5) + 1e-30).all())
    return check


def _not_finite(_):
    return lambda out: not bool(torch.isfinite(out).all())


def _equal(expected):
    return lambda out: torch.equal(out, expected)


def _pruned_ok(x, k):
    """Restored rows equal x on its k largest |x| per row (torch.topk; random data: no ties), 0 elsewhere."""
    def check(p):
        idx = torch.topk(x.abs(), k, dim=-1).indices
        ref = torch.zeros_like(x).scatter_(-1, idx, x.gather(-1, idx))
        return torch.equal(topk_restore(p), ref)
    return check


# ------------------------------------------------------------------ kernels (public API)
KERNEL_CASES = [
    ("quantize-float64", lambda: quantize(_x(4, 8, dtype=torch.float64)), (TypeError, "dtype")),
    ("quantize-int", lambda: quantize(torch.ones(4, dtype=torch.int32)), (TypeError, "dtype")),
    ("quantize-not-tensor", lambda: quantize([1.0, 2.0]), (TypeError, "Tensor")),
    ("quantize-bits3", lambda: quantize(_x(8), bits=3), (ValueError, "bits")),
    ("quantize-bits-bool", lambda: quantize(_x(8), bits=True), (TypeError, "bits")),
    ("quantize-bits-float", lambda: quantize(_x(8), bits=8.0), (TypeError, "bits")),
    ("quantize-group100", lambda: quantize(_x(8), group_size=100), (ValueError, "group_size")),
    ("quantize-seed-negative", lambda: quantize(_x(8), stochastic=True, seed=-1), (ValueError, "seed")),
    ("quantize-seed-float", lambda: quantize(_x(8), stochastic=True, seed=1.5), (TypeError, "seed")),
    ("quantize-empty", lambda: quantize(_x(0, 5), 8, 32), _roundtrip_ok(_x(0, 5), 8)),
    ("quantize-one", lambda: quantize(_x(1), 4, 32), _roundtrip_ok(_x(1), 4)),
    ("quantize-odd", lambda: quantize(_x(3, 37), 4, 32), _roundtrip_ok(_x(3, 37), 4)),
    ("quantize-bf16", lambda: quantize(_x(5, 33, dtype=torch.bfloat16), 8, 32),
     _roundtrip_ok(_x(5, 33, dtype=torch.bfloat16), 8)),
    ("quantize-nan-checked", lambda: quantize(_x(64, fill=NAN), 8, 32, check_finite=True), (ValueError, "NaN")),
    ("quantize-inf-checked", lambda: quantize(_x(64, fill=INF), 8, 32, check_finite=True), (ValueError, "Inf")),
    ("quantize-nan-unchecked", lambda: dequantize(quantize(_x(64, fill=NAN), 8, 32, check_finite=False)),
     _not_finite(None)),
    ("quantize-inf-unchecked", lambda: dequantize(quantize(_x(64, fill=-INF), 8, 32, check_finite=False)),
     _not_finite(None)),
    ("dequantize-too-few-bytes",
     lambda: dequantize(quantize(_x(64), 8, 32)._replace(shape=(128,))), (_NATIVE_OR_PY, "code bytes")),
    ("dequantize-mismatched-parts",
     lambda: dequantize(quantize(_x(64), 8, 32)._replace(scale=torch.ones(1))), (_NATIVE_OR_PY, "groups")),
    ("dequantize-scale-fp16",
     lambda: dequantize(quantize(_x(64), 8, 32)._replace(scale=torch.ones(2, dtype=torch.float16))),
     (_NATIVE_OR_PY, "scale")),
    ("topk-k0", lambda: topk_prune(_x(4, 8), k=0), (ValueError, "k must")),
    ("topk-k-huge", lambda: topk_prune(_x(4, 8), k=10**9), (ValueError, "k must")),
    ("topk-k-bool", lambda: topk_prune(_x(4, 8), k=True), (TypeError, "k must be an int")),
    ("topk-k-float", lambda: topk_prune(_x(4, 8), k=2.7), (TypeError, "k must be an int")),
    ("topk-ratio0", lambda: topk_prune(_x(4, 8), ratio=0.0), (ValueError, "ratio")),
    ("topk-ratio-nan", lambda: topk_prune(_x(4, 8), ratio=NAN), (ValueError, "ratio")),
    ("topk-both", lambda: topk_prune(_x(4, 8), k=2, ratio=0.5), (ValueError, "k or ratio")),
    ("topk-0dim", lambda: topk_prune(torch.tensor(1.0), k=1), (ValueError, "dimension")),
    ("topk-one", lambda: topk_prune(_x(1), k=1), _pruned_ok(_x(1), 1)),
    ("topk-full-row", lambda: topk_prune(_x(3, 5), k=5), _pruned_ok(_x(3, 5), 5)),
    ("topk-empty-rows", lambda: topk_restore(topk_prune(_x(0, 6), k=2)), _equal(torch.zeros(0, 6))),
    ("topk-nan-checked", lambda: topk_prune(_x(4, 8, fill=NAN), k=2, check_finite=True), (ValueError, "NaN")),
    ("topk-restore-bad-index",
     lambda: topk_restore(PrunedTensor(torch.ones(2, 1), torch.tensor([[0], [9]], dtype=torch.int16), 4)),
     (RuntimeError, "index|outside")),
    ("pack-float", lambda: pack_bits(torch.ones(8)), (TypeError, "bool")),
    ("pack-empty", lambda: unpack_bits(pack_bits(torch.zeros(0, dtype=torch.bool)), (0,)),
     _equal(torch.zeros(0, dtype=torch.bool))),
    ("unpack-too-few", lambda: unpack_bits(torch.zeros(1, dtype=torch.uint8), (3, 3)), (ValueError, "bytes")),
    ("unpack-int8", lambda: unpack_bits(torch.zeros(2, dtype=torch.int8), (9,)), (TypeError, "uint8")),
    ("dropout-p-negative", lambda: seeded_dropout(_x(8), -0.1, 1), (ValueError, "p must")),
    ("dropout-p-nan", lambda: seeded_dropout(_x(8), NAN, 1), (ValueError, "p must")),
    ("dropout-p-bool", lambda: seeded_dropout(_x(8), True, 1), (TypeError, "p must be a float")),
    ("dropout-seed-float", lambda: seeded_dropout(_x(8), 0.5, 2.5), (TypeError, "seed")),
    ("dropout-p1", lambda: seeded_dropout(_x(8), 1.0, 1), _equal(torch.zeros(8))),
    ("dropout-seed-negative", lambda: seeded_dropout(_x(8), 0.5, -3), (ValueError, "seed")),
    ("dropout-int-input", lambda: seeded_dropout(torch.ones(8, dtype=torch.int64), 0.5, 1), (TypeError, "dtype")),
    ("dropout-mask-p2", lambda: dropout_mask(_x(8), 2.0, 1), (ValueError, "p must")),
    ("dropout-empty", lambda: seeded_dropout(_x(0, 3), 0.5, 1), _equal(torch.zeros(0, 3))),
]


def _expect(call, expect):
    if isinstance(expect, tuple):
        exc, match = expect
        with pytest.raises(exc, match=match):
            call()
    else:
        out = call()
        assert expect(out), f"silently wrong: {out!r}"


@pytest.mark.parametrize("name,call,expect", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_kernels(name, call, expect):
    _expect(call, expect)


# ------------------------------------------------------------------ the reference backend's own checks
def _reference(op):
    """The kernel that serves devices other than CPU and CUDA (the reference), called directly."""
    ks = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
    kernel = torch.library.get_kernel(f"slimfit::{op}", torch._C.DispatchKey.PrivateUse1)
    return lambda *args: kernel.call_boxed(ks, *args)


_Q = torch.ops.slimfit.quantize(torch.randn(64), 8, 32, False, 0)
REFERENCE_CASES = [
    ("k-above-row", lambda: _reference("topk_prune")(torch.randn(3, 4), 5, True), (ValueError, "k must")),
    ("negative-p", lambda: _reference("seeded_dropout")(torch.randn(8), -0.5, 1), (ValueError, "p must")),
    ("mask-p", lambda: _reference("dropout_mask")(torch.randn(8), 1.5, 1), (ValueError, "p must")),
    ("too-few-packed", lambda: _reference("unpack_bits")(torch.zeros(1, dtype=torch.uint8), 9), (ValueError, "bytes")),
    ("dequantize-parts",
     lambda: _reference("dequantize")(_Q[0], _Q[1][:1], _Q[2], 8, 32, [64], torch.float32), (ValueError, "groups")),
    ("dequantize-bytes",
     lambda: _reference("dequantize")(_Q[0][:10], _Q[1], _Q[2], 8, 32, [64], torch.float32),
     (ValueError, "code bytes")),
    ("quantize-bits", lambda: _reference("quantize")(torch.randn(8), 5, 32, False, 0), (ValueError, "bits")),
    ("restore-index", lambda: _reference("topk_restore")(torch.ones(1, 1), torch.tensor([[7]], dtype=torch.int16), 4),
     (ValueError, "outside")),
    ("restore-row0", lambda: _reference("topk_restore")(torch.ones(1, 1), torch.tensor([[0]], dtype=torch.int16), 0),
     (ValueError, "length 0")),
    ("pack-float", lambda: _reference("pack_bits")(torch.ones(3)), (TypeError, "bool")),
    ("ok-topk", lambda: _reference("topk_prune")(torch.tensor([[1.0, -3.0, 2.0]]), 2, True)[0],
     _equal(torch.tensor([[-3.0, 2.0]]))),
]


@pytest.mark.parametrize("name,call,expect", REFERENCE_CASES, ids=[c[0] for c in REFERENCE_CASES])
def test_reference_backend_checks_like_the_native_kernels(name, call, expect):
    _expect(call, expect)


# ------------------------------------------------------------------ gradients through the ops
def test_ops_on_requires_grad_inputs_keep_their_gradient():
    x = _x(4, 8).requires_grad_()
    (seeded_dropout(x, 0.0, 1) + 2 * x).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    x.grad = None
    (topk_restore(topk_prune(x, k=8)) + 2 * x).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    x.grad = None
    y = seeded_dropout(x, 0.5, 7)
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g, seeded_dropout(torch.ones_like(x), 0.5, 7))
    with pytest.raises(RuntimeError, match="not differentiable"):
        dequantize(quantize(x, 8, 32)).sum().backward()


# ------------------------------------------------------------------ autograd functions
def _grads_match(fn, ref, *inputs, tol=0.0):
    def run(f):
        leaves = [t.detach().clone().requires_grad_() if t is not None and t.is_floating_point() else t for t in inputs]
        out = f(*leaves)
        g = torch.ones_like(out)
        return out, torch.autograd.grad(out, [t for t in leaves if t is not None and t.requires_grad], g)

    def check(_):
        a, ga = run(fn)
        b, gb = run(ref)
        return torch.allclose(a, b, atol=tol, rtol=tol) and all(
            torch.allclose(x, y, atol=tol, rtol=tol, equal_nan=True) for x, y in zip(ga, gb))
    return check


_W, _B = _x(6, 8), _x(6)
AUTOGRAD_CASES = [
    ("linear-shape", lambda: sf.linear(_x(3, 5), _W), (ValueError, "shape|in_features")),
    ("linear-dtype-mix", lambda: sf.linear(_x(3, 8, dtype=torch.bfloat16), _W), (TypeError, "dtype")),
    ("linear-float64", lambda: sf.linear(_x(3, 8, dtype=torch.float64), _W.double()), (TypeError, "dtype")),
    ("linear-bits3", lambda: sf.linear(_x(3, 8), _W, input_bits=3), (ValueError, "input_bits")),
    ("linear-empty", lambda: sf.linear(_x(0, 8), _W, _B), _equal(torch.zeros(0, 6))),
    ("linear-exact", lambda: None, _grads_match(lambda x, w, b: sf.linear(x, w, b), F.linear, _x(3, 8), _W, _B)),
    ("gelu-bits1", lambda: sf.gelu(_x(4), bits=1), (ValueError, "bits")),
    ("gelu-approx", lambda: sf.gelu(_x(4), approximate="fast"), (ValueError, "approximate")),
    ("layernorm-save", lambda: sf.layer_norm(_x(2, 4), (4,), save="int3"), (ValueError, "save")),
    ("layernorm-exact", lambda: None,
     _grads_match(lambda x: sf.layer_norm(x, (8,), save="full"), lambda x: F.layer_norm(x, (8,)), _x(3, 8), tol=1e-5)),
    ("dropout-mode", lambda: sf.dropout(_x(4), 0.5, mode="mask"), (ValueError, "mode")),
    ("dropout-p", lambda: sf.dropout(_x(4), 1.5), (ValueError, "p must")),
    ("matmul-bits", lambda: sf.matmul(_x(2, 3), _x(3, 2), a_bits=5), (ValueError, "a_bits")),
    ("sampled-ratio0", lambda: sampled_linear(_x(3, 8), _W, ratio=0.0), (ValueError, "ratio")),
    ("sampled-sampler", lambda: sampled_linear(_x(3, 8), _W, sampler="topk"), (ValueError, "sampler")),
    ("sampled-seed-bool", lambda: sampled_linear(_x(3, 8), _W, generator_seed=True), (TypeError, "generator_seed")),
    ("sampled-nan-weight-grad", lambda: _nan_weight_grad(), lambda g: not bool(torch.isfinite(g).all())),
    ("attention-probs", lambda: sf.attention(_x(1, 2, 4, 8), _x(1, 2, 4, 8), _x(1, 2, 4, 8), probs="int3"),
     (ValueError, "probs")),
    ("attention-shape", lambda: sf.attention(_x(1, 2, 4, 8), _x(1, 2, 4, 7), _x(1, 2, 4, 8)),
     (ValueError, "head dims")),
]


def _nan_weight_grad():
    w = _W.clone().requires_grad_()
    y = sampled_linear(_x(4, 30, 8, fill=NAN), w, ratio=0.1, k_min=1, generator_seed=1)
    return torch.autograd.grad(y.sum(), w)[0]


@pytest.mark.parametrize("name,call,expect", AUTOGRAD_CASES, ids=[c[0] for c in AUTOGRAD_CASES])
def test_autograd_functions(name, call, expect):
    _expect(call, expect)


# ------------------------------------------------------------------ patch / unpatch / memory
def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.LayerNorm(16), nn.Linear(16, 2))


PATCH_CASES = [
    ("not-a-module", lambda: slimfit.patch("model"), (TypeError, "torch.nn.Module")),
    ("config-dict", lambda: slimfit.patch(_net(), {"gelu_bits": 4}), (TypeError, "SlimFitConfig")),
    ("target-int", lambda: slimfit.patch(_net(), target_modules=3), (TypeError, "target_modules")),
    ("exclude-bad-regex", lambda: slimfit.patch(_net(), exclude_modules="("), (ValueError, "exclude_modules")),
    ("config-bits", lambda: SlimFitConfig(gelu_bits=5), (ValueError, "gelu_bits")),
    ("config-bits-bool", lambda: SlimFitConfig(linear_input_bits=True), (ValueError, "linear_input_bits")),
    ("config-group", lambda: SlimFitConfig(group_size=100), (ValueError, "group_size")),
    ("config-ratio", lambda: SlimFitConfig.exact().with_sampling(ratio=0), (ValueError, "LinearSampling.ratio")),
    ("config-unknown-key", lambda: SlimFitConfig.from_dict({"gelu_bit": 4}), (ValueError, "gelu_bit")),
    ("compile-unpatched", lambda: slimfit.compile(_net()), (ValueError, "slimfit.patch")),
    ("memory-meta", lambda: memory.measure(nn.Linear(2, 2, device="meta"), torch.ones(1, 2)), (ValueError, "meta")),
    ("memory-not-callable", lambda: memory.measure(3, torch.ones(2)), (TypeError, "callable|not callable")),
]


@pytest.mark.parametrize("name,call,expect", PATCH_CASES, ids=[c[0] for c in PATCH_CASES])
def test_patch_and_memory(name, call, expect):
    _expect(call, expect)


def test_patched_net_matches_plain_and_unpatch_restores():
    plain, patched = _net(), _net()
    slimfit.patch(patched, SlimFitConfig.exact())
    x = _x(5, 8)
    plain.eval(), patched.eval()
    with torch.no_grad():
        assert torch.equal(plain(x), patched(x))
    plain.train(), patched.train()
    plain[2].p = patched[2].p = 0.0  # same computation with gradients
    gp = torch.autograd.grad(plain(x).sum(), list(plain.parameters()))
    gs = torch.autograd.grad(patched(x).sum(), list(patched.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(gp, gs))
    slimfit.unpatch(patched)
    assert [type(m) for m in patched] == [type(m) for m in plain]
    with pytest.warns(UserWarning, match="not patched"):
        slimfit.unpatch(patched)


def test_memory_counts_real_bytes_and_leaves_no_grad():
    net = _net()
    x = _x(4, 8)
    run = memory.measure(net, x, loss_fn=lambda out: out.sum())
    assert run.total > 0 and all(p.grad is None for p in net.parameters())
    assert memory.measure(net, x, backward=False).total == run.total
