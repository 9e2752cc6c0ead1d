"""Every compressing autograd Function of slimfit.autograd on bf16 inputs and weights: the output in bf16
(the chunked LM loss: fp32, as transformers' loss), the forward bit-identical to PyTorch's bf16 op where the
Function computes it with the same arithmetic, gradients against PyTorch's bf16 op and against fp32 within a
bound derived from the fp32 compression error and bf16's rounding, and the bytes saved: compressed codes
(uint8 codes, fp32 scales) cost the same in bf16 as in fp32, what is kept in full costs 2 bytes an element.

The bound. Let e_comp be the Function's gradient error against PyTorch in fp32 (compression only) and e_bf16
PyTorch's own bf16 error against fp32 on the same inputs (rounding only; about bf16's unit roundoff 2**-8
times a small factor). In bf16 the Function's error against fp32 must stay within e_comp + 2·e_bf16:
flash-attention's rule (a low-precision kernel's error at most twice PyTorch's) for the rounding, on top of
the compression. Against PyTorch's bf16 op the triangle inequality adds one e_bf16."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from slimfit import autograd as A
from slimfit.memory import measure

G = 128   # group size of every quantized format here


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def q_bytes(numel: int, bits: int) -> int:
    """Bytes of a per-group quantized tensor: packed codes + fp32 scale and offset per group."""
    return math.ceil(numel * bits / 8) + 8 * math.ceil(numel / G)


def _hf_rms(x, w, eps=1e-6):
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


LABELS = torch.randint(0, 1000, (2, 33), generator=torch.Generator().manual_seed(3))


def _ce(h, w):
    return F.cross_entropy(F.linear(h, w).float().view(-1, 1000), LABELS.view(-1))


@dataclass
class Case:
    fn: Callable
    ref: Callable
    shapes: tuple          # (shape, scale, is a parameter) per input
    saved: Callable        # element size of the input dtype -> bytes saved for backward
    exact_fwd: bool = True
    exact_grads: tuple = ()   # indices of gradients computed without compressed data: bit-identical


X, W, N = (4, 33, 256), (192, 256), 4 * 33 * 256
ROWS = 4 * 33
QKV = ((2, 4, 40, 32), 1.0, False)
CASES = {
    "linear-8bit": Case(lambda x, w, b: A.linear(x, w, b, input_bits=8), F.linear,
                        ((X, 1.0, False), (W, 0.05, True), ((192,), 0.05, True)), lambda es: q_bytes(N, 8),
                        exact_grads=(0, 2)),
    "linear-4bit": Case(lambda x, w, b: A.linear(x, w, b, input_bits=4), F.linear,
                        ((X, 1.0, False), (W, 0.05, True), ((192,), 0.05, True)), lambda es: q_bytes(N, 4),
                        exact_grads=(0, 2)),
    "linear-full": Case(lambda x, w: A.linear(x, w), F.linear, ((X, 1.0, False), (W, 0.05, True)),
                        lambda es: N * es, exact_grads=(0, 1)),
    "silu-4bit": Case(lambda x: A.silu(x, bits=4), F.silu, ((X, 1.0, False),), lambda es: q_bytes(N, 4)),
    "gelu-4bit": Case(lambda x: A.gelu(x, bits=4), F.gelu, ((X, 1.0, False),), lambda es: q_bytes(N, 4)),
    "swiglu-4bit": Case(lambda g, u: A.swiglu(g, u, bits=4), lambda g, u: F.silu(g) * u,
                        ((X, 1.0, False), (X, 1.0, False)), lambda es: 2 * q_bytes(N, 4)),
    "geglu-4bit": Case(lambda g, u: A.geglu(g, u, bits=4), lambda g, u: F.gelu(g, approximate="tanh") * u,
                       ((X, 1.0, False), (X, 1.0, False)), lambda es: 2 * q_bytes(N, 4)),
    "rms_norm-int8": Case(lambda x, w: A.rms_norm(x, w, 1e-6), _hf_rms, ((X, 1.0, False), ((256,), 1.0, True)),
                          lambda es: q_bytes(N, 8) + 4 * ROWS),      # x̂ 8-bit + fp32 rstd per row
    "rms_norm-full": Case(lambda x, w: A.rms_norm(x, w, 1e-6, save="full"), _hf_rms,
                          ((X, 1.0, False), ((256,), 1.0, True)), lambda es: N * es + 4 * ROWS),
    "layer_norm-int8": Case(lambda x, w, b: A.layer_norm(x, (256,), w, b, 1e-5),
                            lambda x, w, b: F.layer_norm(x, (256,), w, b, 1e-5),
                            ((X, 1.0, False), ((256,), 1.0, True), ((256,), 0.1, True)),
                            lambda es: q_bytes(N, 8) + 4 * ROWS),
    "matmul-8bit": Case(lambda a, b: A.matmul(a, b, a_bits=8, b_bits=8), torch.matmul,
                        (((3, 40, 64), 1.0, False), ((3, 64, 48), 1.0, False)),
                        lambda es: q_bytes(3 * 40 * 64, 8) + q_bytes(3 * 64 * 48, 8)),
    "attention-P-full": Case(lambda q, k, v: A.attention(q, k, v, is_causal=True), _sdpa, (QKV, QKV, QKV),
                             lambda es: 3 * q_bytes(10240, 8) + 2 * 4 * 40 * 40 * es, exact_fwd=False),
    "attention-P-recompute": Case(lambda q, k, v: A.attention(q, k, v, is_causal=True, probs="recompute"),
                                  _sdpa, (QKV, QKV, QKV), lambda es: 3 * q_bytes(10240, 8), exact_fwd=False),
    "fused_attention-gqa": Case(lambda q, k, v: A.fused_attention(q, k, v, is_causal=True), _sdpa,
                                (QKV, ((2, 2, 40, 32), 1.0, False), ((2, 2, 40, 32), 1.0, False)),
                                lambda es: q_bytes(10240, 8) + 2 * q_bytes(5120, 8)),
    "linear_cross_entropy": Case(lambda h, w: A.linear_cross_entropy(h, w, None, LABELS), _ce,
                                 (((2, 33, 64), 1.0, False), ((1000, 64), 0.05, True)),
                                 # hidden states in full, per row an fp32 log-sum-exp and an int64 label,
                                 # the fp32 denominator
                                 lambda es: 2 * 33 * 64 * es + 66 * (4 + 8) + 4, exact_fwd=False, exact_grads=(0,)),
    "layer_scale-8bit": Case(lambda x, w: A.layer_scale(x, w), lambda x, w: x * w,
                             ((X, 1.0, False), ((256,), 1.0, True)), lambda es: q_bytes(N, 8), exact_grads=(0,)),
    "row_scale-8bit": Case(lambda y, w: A.row_scale(y, w), lambda y, w: y * w[..., None],
                           ((X, 1.0, False), ((4, 33), 1.0, False)), lambda es: q_bytes(N, 8) + ROWS * es,
                           exact_grads=(0,)),
}


def _inputs(case: Case, dtype: torch.dtype, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape, scale, param in case.shapes:
        t = (torch.randn(shape, generator=gen) * scale).to(dtype)
        out.append(torch.nn.Parameter(t) if param else t.requires_grad_())
    return out


def _run(fn, inputs, grad_seed=1):
    y = fn(*inputs)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(grad_seed)).to(y.dtype)
    return y, torch.autograd.grad(y, inputs, g)


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_output_and_gradients_within_derived_bound(name):
    case = CASES[name]
    y32, g32 = _run(case.ref, _inputs(case, torch.float32))
    _, gc32 = _run(case.fn, _inputs(case, torch.float32))
    y16, g16 = _run(case.ref, _inputs(case, torch.bfloat16))
    out, got = _run(case.fn, _inputs(case, torch.bfloat16))
    assert out.dtype == y16.dtype == (torch.float32 if name == "linear_cross_entropy" else torch.bfloat16)
    if case.exact_fwd:
        assert torch.equal(out, y16)
    else:   # another order of the same fp32 sums: held to PyTorch's own bf16 error, twice
        assert rel(out, y32) <= 2 * rel(y16, y32) + 2.0 ** -24
    for i, (g, ref, ref16, comp) in enumerate(zip(got, g32, g16, gc32)):
        assert g.dtype == torch.bfloat16 and torch.isfinite(g).all(), i
        if i in case.exact_grads:
            assert torch.equal(g, ref16), i
            continue
        e_comp, e_bf = rel(comp, ref), rel(ref16, ref)
        assert rel(g, ref) <= e_comp + 2 * e_bf, (i, rel(g, ref), e_comp, e_bf)
        assert rel(g, ref16) <= e_comp + 3 * e_bf, (i, rel(g, ref16), e_comp, e_bf)


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_saved_bytes(name):
    """What is compressed costs the same in bf16 as in fp32; what is kept in full, half."""
    case = CASES[name]
    for dtype, es in ((torch.float32, 4), (torch.bfloat16, 2)):
        got = measure(case.fn, *_inputs(case, dtype), backward=False).total
        assert got == case.saved(es), (dtype, got, case.saved(es))


def test_bf16_frozen_linear_saves_nothing_and_is_bit_exact():
    x = torch.randn(3, 7, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(48, 64, dtype=torch.bfloat16) * 0.1, requires_grad=False)
    y = A.linear(x, w, input_bits=8)
    assert torch.equal(y, F.linear(x, w))
    assert measure(lambda t: A.linear(t, w, input_bits=8), x, backward=False).total == 0
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    (rx,) = torch.autograd.grad(F.linear(x, w), x, g)
    assert torch.equal(gx, rx)
