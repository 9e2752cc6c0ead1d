"""The fused attention path on a CUDA device (run with: pytest -m gpu).

Reference: PyTorch's scaled_dot_product_attention held to the same kernel with `sdpa_kernel`, so
"bit for bit" compares the same arithmetic; gradients of the 8-bit format against SDPA at the dequantized
point (the recompute backward is that gradient exactly, up to the kernel's own rounding).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_fused_attention import LargeAllocations, key_padding, make_qkv, rel
from torch.nn.attention import SDPBackend, sdpa_kernel

from slimfit.autograd.fused_attention import BACKWARD_MODES, fused_attention, fused_kernel, quantized_bytes
from slimfit.kernels import dequantize, quantize
from slimfit.memory import saved_bytes

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
KERNELS = {"cuda_flash": SDPBackend.FLASH_ATTENTION, "cuda_efficient": SDPBackend.EFFICIENT_ATTENTION}


def cuda_qkv(dtype=torch.bfloat16, **kw):
    return tuple(t.to("cuda") for t in make_qkv(dtype=dtype, **kw))


def run(fn, q, k, v, seed=1, **kw):
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(qq, kk, vv, **kw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    out.backward(g)
    return out.detach(), (qq.grad, kk.grad, vv.grad)


def sdpa_on(kernel):
    def call(q, k, v, **kw):
        with sdpa_kernel([KERNELS[kernel]]):
            return F.scaled_dot_product_attention(q, k, v, **kw)
    return call


def test_kernel_choices():
    q, k, v = cuda_qkv(d=64)
    assert fused_kernel(q, k, v, None, 0.0, True) == "cuda_flash"
    mask = key_padding(2, 64, [64, 30], "bool").cuda()
    assert fused_kernel(q, k, v, mask, 0.0, False) == "cuda_efficient"          # flash takes no mask
    assert fused_kernel(*(t.float() for t in (q, k, v)), None, 0.0, True) == "cuda_efficient"  # fp32
    assert fused_kernel(*cuda_qkv(d=20), None, 0.0, True) is None             # head dim not a multiple of 8


@pytest.mark.parametrize("mode", BACKWARD_MODES)
@pytest.mark.parametrize("case", ["flash-causal", "efficient-mask", "efficient-fp32"])
def test_uncompressed_equals_sdpa_on_the_same_kernel(case, mode):
    dtype = torch.float32 if case == "efficient-fp32" else torch.bfloat16
    q, k, v = cuda_qkv(dtype=dtype, hq=4, hk=4, sq=77, d=64)
    kw = {"is_causal": True} if case != "efficient-mask" else {
        "attn_mask": key_padding(2, 77, [77, 40], "bool").cuda()}
    kernel = fused_kernel(q, k, v, kw.get("attn_mask"), 0.0, kw.get("is_causal", False))
    assert kernel == ("cuda_flash" if case == "flash-causal" else "cuda_efficient")
    out, grads = run(fused_attention, q, k, v, qkv_bits=None, backward=mode, **kw)
    ref, rgrads = run(sdpa_on(kernel), q, k, v, **kw)
    assert torch.equal(out, ref)
    for g, r in zip(grads, rgrads):
        assert torch.equal(g, r)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_query_gradients_match_sdpa(dtype):
    q, k, v = cuda_qkv(dtype=dtype, hq=8, hk=2, sq=96, d=64)
    out, grads = run(fused_attention, q, k, v, qkv_bits=None, is_causal=True)
    ref, rgrads = run(F.scaled_dot_product_attention, q.double(), k.double(), v.double(), is_causal=True,
                      enable_gqa=True)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel(out, ref) < tol and all(rel(g, r) < tol for g, r in zip(grads, rgrads))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_recompute_is_the_gradient_at_the_dequantized_point(dtype):
    q, k, v = cuda_qkv(dtype=dtype, hq=4, hk=4, sq=128, d=64)
    deq = [dequantize(quantize(t, 8, 128)) for t in (q, k, v)]
    out, grads = run(fused_attention, q, k, v, is_causal=True)
    ref, _ = run(sdpa_on(fused_kernel(q, k, v, None, 0.0, True)), q, k, v, is_causal=True)
    _, at_deq = run(fused_attention, *deq, qkv_bits=None, is_causal=True)
    assert torch.equal(out, ref)
    for g, r in zip(grads, at_deq):
        assert rel(g, r) < (1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_dropout_replays_the_forward_mask():
    """With dropout the same seed gives SDPA's output on the same kernel, and the backward replays that mask."""
    q, k, v = cuda_qkv(hq=4, hk=4, sq=64, d=64)
    torch.manual_seed(0)
    out, grads = run(fused_attention, q, k, v, qkv_bits=None, dropout_p=0.2, is_causal=True)
    torch.manual_seed(0)
    ref, rgrads = run(sdpa_on("cuda_flash"), q, k, v, dropout_p=0.2, is_causal=True)
    assert torch.equal(out, ref) and all(torch.equal(g, r) for g, r in zip(grads, rgrads))


@pytest.mark.parametrize("qkv_bits", [None, 8, 4])
def test_saved_bytes_match_format(qkv_bits):
    b, hq, hk, s, d, gs = 2, 8, 2, 64, 64, 64
    q, k, v = (t.requires_grad_() for t in cuda_qkv(b=b, hq=hq, hk=hk, sq=s, d=d))
    n_q, n_kv = b * hq * s * d, b * hk * s * d
    expect = (n_q + 2 * n_kv) * 2 if qkv_bits is None else (
        quantized_bytes(n_q, qkv_bits, gs) + 2 * quantized_bytes(n_kv, qkv_bits, gs))
    got = saved_bytes(lambda: fused_attention(q, k, v, is_causal=True, qkv_bits=qkv_bits, group_size=gs))
    assert 0 <= got - expect <= 64   # and the CUDA kernel's RNG seed and offset: 24 bytes on an H200


@pytest.mark.parametrize("mask", [None, "key_padding"])
def test_no_s_by_s_tensor_in_a_training_step_at_seq_2048(mask):
    s = 2048
    q, k, v = cuda_qkv(b=1, hq=4, hk=2, sq=s, d=64)
    kw = {"is_causal": True} if mask is None else {"attn_mask": key_padding(1, s, [1900], "bool").cuda()}
    with LargeAllocations(s * s) as rec:
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        fused_attention(qq, kk, vv, **kw).float().sum().backward()
    assert rec.seen == []
