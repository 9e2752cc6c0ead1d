"""slimfit.autograd.rms_norm: forward bit-identical to LlamaRMSNorm; backward from x_hat (int8 /
top-k / full) and rstd only."""
import math

import pytest
import torch
import torch.nn.functional as F
from _grad_utils import (  # noqa: F401  (single_thread: autouse fixture)
    OUTLIER_CHANNELS,
    cos_sim,
    nonfinite_missed,
    q_bytes,
    quant_rel_err_theory,
    rel_err,
    saved,
    single_thread,
)

from slimfit.autograd.layernorm import topk_keep
from slimfit.autograd.rmsnorm import rms_norm

llama = pytest.importorskip("transformers.models.llama.modeling_llama")

H = 576  # SmolLM-135M's hidden size: not a multiple of the group size 128
MODES = ["full", "int8", "topk"]


def _hf(d, eps=1e-5, seed=0):
    m = llama.LlamaRMSNorm(d, eps=eps)
    m.weight.data = torch.rand(d, generator=torch.Generator().manual_seed(seed)) * 0.5 + 0.75
    return m


def _grads(y, inputs, g):
    return torch.autograd.grad(y, [t for t in inputs if t.requires_grad], g)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4, 64), (2, 5, 77), (1, 576), (3, 1, 130), (0, 32)])
def test_forward_bit_identical_to_llama_rmsnorm(mode, dtype, shape):
    m = _hf(shape[-1])
    x = (torch.randn(shape) * 3 + 0.5).to(dtype).requires_grad_()
    y = rms_norm(x, m.weight, m.variance_epsilon, save=mode)
    y_ref = m(x)
    assert y.dtype == y_ref.dtype and torch.equal(y, y_ref)
    g = torch.randn_like(y)
    got, ref = _grads(y, [x, m.weight], g), _grads(y_ref, [x, m.weight], g)
    for a, c in zip(got, ref):
        assert a.shape == c.shape and a.dtype == c.dtype
    if mode == "full" and dtype == torch.float32:  # same math as autograd's, from x_hat and rstd
        for a, c in zip(got, ref):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_no_weight_frozen_weight_and_no_grad():
    m = _hf(64)
    x = torch.randn(8, 64, requires_grad=True)
    ref = F.rms_norm(x, (64,), None, 1e-6)  # PyTorch's own RMSNorm, same formula without a weight
    torch.testing.assert_close(rms_norm(x, None, 1e-6), ref, rtol=1e-6, atol=1e-6)
    g = torch.randn(8, 64)
    (gx,) = torch.autograd.grad(rms_norm(x, None, 1e-6, save="full"), x, g)
    torch.testing.assert_close(gx, torch.autograd.grad(ref, x, g)[0], rtol=1e-5, atol=1e-6)
    m.weight.requires_grad_(False)
    y = rms_norm(x, m.weight, m.variance_epsilon, save="topk")
    assert torch.equal(y, m(x))
    assert torch.autograd.grad(y, x, g)[0].shape == x.shape
    with torch.no_grad():
        assert torch.equal(rms_norm(x, m.weight, m.variance_epsilon), m(x))


def _residual_stream(seed=0, rows=256):
    """A pre-norm residual stream: shared mean direction, a few large outlier channels."""
    gen = torch.Generator().manual_seed(seed)
    e = torch.randn(rows, H, generator=gen) * 0.5 + torch.randn(1, H, generator=gen) * 0.3
    e[..., list(OUTLIER_CHANNELS[:2])] += 6.0
    return e.requires_grad_()


@pytest.fixture(scope="module")
def realistic():
    """RMSNorm -> linear -> regression: the upstream gradient correlates with x_hat."""
    torch.manual_seed(0)
    x = _residual_stream()
    m = _hf(H)
    w2 = torch.randn(256, H) * 0.03
    with torch.no_grad():
        target = m(x + 0.1 * torch.randn_like(x)) @ w2.T

    def grads(fn):
        return torch.autograd.grad(F.mse_loss(fn(x) @ w2.T, target), [x, m.weight])

    return m, grads, grads(m)


@pytest.mark.parametrize("mode, dx_max_rel, dw_max_rel", [("full", 1e-6, 1e-6), ("int8", 2e-3, 5e-3)])
def test_grad_error_realistic(realistic, mode, dx_max_rel, dw_max_rel):
    """Measured: full dx 5.2e-8, dw 0; int8 dx 9.4e-4, dw 3.7e-3."""
    m, grads, exact = realistic
    gx, gw = grads(lambda x: rms_norm(x, m.weight, m.variance_epsilon, save=mode))
    assert rel_err(gx, exact[0]) <= dx_max_rel
    assert rel_err(gw, exact[1]) <= dw_max_rel


def test_topk_grad_realistic(realistic):
    """x_hat enters dx only through the projection term x_hat·mean(gw·x_hat): top-10% keeps dx
    close (measured cos 0.9973, rel 7.4e-2); the weight gradient sees the kept entries only
    (measured cos 0.930), which is why top-k is for frozen norms (paper(): layernorm_frozen='topk')."""
    m, grads, exact = realistic
    gx, gw = grads(lambda x: rms_norm(x, m.weight, m.variance_epsilon, save="topk", keep_ratio=0.1))
    assert cos_sim(gx, exact[0]) >= 0.995
    assert cos_sim(gw, exact[1]) >= 0.9


def test_int8_random_gradient():
    """Gaussian rows, independent gradient: dw inherits x_hat's 8-bit rounding error (theory 5.9e-3,
    measured 5.5e-3); dx feels it only through the projection term (measured 3.5e-4)."""
    torch.manual_seed(0)
    x = torch.randn(256, H, requires_grad=True)
    m = _hf(H)
    g = torch.randn(256, H)
    exact = torch.autograd.grad(m(x), [x, m.weight], g)
    got = torch.autograd.grad(rms_norm(x, m.weight, m.variance_epsilon, save="int8"), [x, m.weight], g)
    assert rel_err(got[0], exact[0]) <= 1e-3
    assert rel_err(got[1], exact[1]) <= 1.3 * quant_rel_err_theory(8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 64), (2, 5, 577), (1, 576), (3, 4, 130)])
def test_bytes_saved(dtype, shape):
    """x_hat compressed + fp32 rstd per row; the weight is a parameter (not counted). The HF module
    keeps x in fp32 (for pow and the product with rstd), rstd, and x_hat cast to the input dtype."""
    m = _hf(shape[-1])
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    d = shape[-1]
    n, rows, e = x.numel(), x.numel() // d, x.element_size()

    def fn(mode):
        return lambda t: rms_norm(t, m.weight, m.variance_epsilon, save=mode)

    assert saved(fn("int8"), x) == q_bytes(n, 8) + 4 * rows
    assert saved(fn("topk"), x) == rows * topk_keep(0.1, d) * (e + 2) + 4 * rows
    assert saved(fn("full"), x) == n * e + 4 * rows
    assert saved(m, x) == n * 4 + 4 * rows + (n * 4 if dtype == torch.float32 else n * e)


def test_autocast_and_half_precision():
    """bf16 input: the gradient is within 2x of PyTorch's own bf16 error against an fp32 reference."""
    m = _hf(H)
    x32 = _residual_stream(rows=64).detach()
    g = torch.randn(64, H)
    (ref32,) = torch.autograd.grad(m(x32.requires_grad_()), x32, g)
    xb = x32.detach().bfloat16().requires_grad_()
    (hf,) = torch.autograd.grad(m(xb), xb, g)
    (ours,) = torch.autograd.grad(rms_norm(xb, m.weight, m.variance_epsilon, save="full"), xb, g)
    assert ours.dtype == torch.bfloat16
    assert rel_err(ours, ref32) <= 2 * rel_err(hf, ref32)
    x = torch.randn(4, H, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(rms_norm(x, m.weight, m.variance_epsilon), m(x))


def test_stochastic_int8_weight_grad_converges():
    torch.manual_seed(0)
    m = _hf(256)
    x = torch.randn(16, 256, requires_grad=True)
    g = torch.randn(16, 256)
    (exact,) = torch.autograd.grad(m(x), m.weight, g)
    samples = torch.stack([torch.autograd.grad(rms_norm(x, m.weight, m.variance_epsilon, stochastic=True),
                                               m.weight, g)[0] for _ in range(32)])
    err1 = sum(rel_err(s, exact) for s in samples[:8]) / 8
    for n in (4, 32):  # dw is linear in x_hat: unbiased
        assert rel_err(samples[:n].mean(0), exact) <= 2 * err1 / math.sqrt(n)


def test_errors_name_the_problem():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.ones(8)
    with pytest.raises(ValueError, match="save must be one of"):
        rms_norm(x, w, save="int4")
    with pytest.raises(ValueError, match="keep_ratio"):
        rms_norm(x, w, save="topk", keep_ratio=0)
    with pytest.raises(ValueError, match="mismatched shapes"):
        rms_norm(x, torch.ones(7))
    with pytest.raises(TypeError, match="unsupported dtype torch.float64"):
        rms_norm(x.double(), w.double())
    with pytest.raises(RuntimeError, match="slimfit.rms_norm: double backward"):
        torch.autograd.grad(rms_norm(x, w).sum(), x, create_graph=True)


# ------------------------------------------------------------------ NaN / Inf stay visible (issue #30)
NAN, INF = float("nan"), float("inf")


def _hf_formula(x, weight, eps):
    """LlamaRMSNorm's forward as a function (autograd gives PyTorch's gradients)."""
    h = x.to(torch.float32)
    y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight", ["trainable", "frozen", None])
@pytest.mark.parametrize("pattern", [("one", NAN), ("one", INF), ("many", INF), ("many", -INF), ("row", NAN)])
@pytest.mark.parametrize("into", ["input", "grad"])
def test_nonfinite_reaches_every_gradient(mode, dtype, weight, pattern, into):
    """Wherever the HF formula's gradients are NaN/Inf, slimfit's are too, in every mode. An Inf input
    makes rstd 0 (finite) and x̂ NaN at the Inf entries only: with more of them than top-k keeps (3 > k = 2)
    the dropped ones must still reach dw; a NaN makes the whole row NaN (top-k keeps 2 of 16)."""
    gen = torch.Generator().manual_seed(0)
    x0, g = (torch.randn(4, 16, generator=gen).to(dtype) for _ in range(2))
    v = (x0 if into == "input" else g).view(-1, 16)
    kind, value = pattern
    v[1, {"one": [3], "many": [0, 5, 9], "row": slice(None)}[kind]] = value
    w0 = (torch.rand(16, generator=gen) + 0.5).to(dtype)
    grads = []
    for fn in (_hf_formula, lambda x, w, eps: rms_norm(x, w, eps, save=mode)):
        x = x0.clone().requires_grad_()
        w = None if weight is None else w0.clone().requires_grad_(weight == "trainable")
        grads.append(_grads(fn(x, w, 1e-6), [x] + ([] if w is None else [w]), g))
    assert not nonfinite_missed(grads[1], grads[0])


def test_argument_errors_name_the_problem_and_the_fix():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    for eps in (float("nan"), -1e-6, None):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            rms_norm(x, w, eps=eps)
    with pytest.raises(ValueError, match="keep_ratio must be a number in"):
        rms_norm(x, w, save="int8", keep_ratio=float("nan"))
    with pytest.raises(TypeError, match="check_finite must be True or False"):
        rms_norm(x, w, check_finite="yes")
    with pytest.raises(ValueError, match="different devices .*weight on meta.*move them to one device"):
        rms_norm(x, torch.ones(8, device="meta", requires_grad=True))
