"""slimfit.autograd.silu: exact forward, exact derivative at the dequantized input."""
import math

import pytest
import torch
import torch.nn.functional as F
from _grad_utils import (  # noqa: F401  (single_thread: autouse fixture)
    bert_like_hidden,
    cos_sim,
    nonfinite_missed,
    q_bytes,
    rel_err,
    saved,
    single_thread,
)

from slimfit.autograd.silu import silu
from slimfit.kernels import dequantize, quantize


def _gate_preactivations(seed=0):
    """SiLU inputs as in a SwiGLU MLP: BERT-like hidden states (outlier channels) times a
    768x2048 projection (std ~0.9, |x| up to ~18)."""
    gen = torch.Generator().manual_seed(seed)
    x = bert_like_hidden(batch=1, seq=128, seed=seed)
    w = torch.randn(2048, 768, generator=gen) * 0.03
    return (x @ w.T).requires_grad_()


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 77), (2, 5, 128), (0, 16)])
def test_forward_exact_and_backward_is_exact_derivative_at_dequantized_input(bits, shape):
    x = (torch.randn(shape) * 3).requires_grad_()
    y = silu(x, bits=bits)
    assert torch.equal(y, F.silu(x))
    g = torch.randn_like(y)
    (got,) = torch.autograd.grad(y, x, g)
    xq = dequantize(quantize(x.detach(), bits, 128)).requires_grad_()
    (expected,) = torch.autograd.grad(F.silu(xq), xq, g)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_matches_transformers_silu_activation():
    act = pytest.importorskip("transformers.activations")
    x = torch.randn(4, 96, requires_grad=True)
    assert torch.equal(silu(x, bits=8), act.SiLUActivation()(x))


@pytest.mark.parametrize("bits, max_rel, min_cos", [(8, 7e-3, 0.99995), (4, 0.11, 0.994)])
def test_grad_error_realistic(bits, max_rel, min_cos):
    """SwiGLU gate pre-activations (outlier channels widen the groups' ranges) with a random
    upstream gradient. SiLU is elementwise: the error is that of SiLU' (|SiLU''| <= 0.5) at the
    rounded inputs. Measured: 8-bit 5.3e-3 (cos 0.99999), 4-bit 8.9e-2 (cos 0.9961)."""
    h = _gate_preactivations()
    g = torch.randn(h.shape, generator=torch.Generator().manual_seed(2))
    (exact,) = torch.autograd.grad(F.silu(h), h, g)
    (got,) = torch.autograd.grad(silu(h, bits=bits), h, g)
    assert rel_err(got, exact) <= max_rel
    assert cos_sim(got, exact) >= min_cos


@pytest.mark.parametrize("bits, min_cos", [(8, 0.9999), (4, 0.99), (2, 0.9)])
def test_grad_error_random_gradient(bits, min_cos):
    """N(0, 1) inputs, independent gradient. Measured cos: 8-bit 0.999993, 4-bit 0.998, 2-bit 0.956."""
    torch.manual_seed(0)
    x = torch.randn(64, 768, requires_grad=True)
    g = torch.randn_like(x)
    (exact,) = torch.autograd.grad(F.silu(x), x, g)
    (got,) = torch.autograd.grad(silu(x, bits=bits), x, g)
    assert cos_sim(got, exact) >= min_cos


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("shape", [(3, 77), (4, 128, 64), (1,), (0, 8)])
def test_bytes_saved(bits, shape):
    x = torch.randn(shape, requires_grad=True)
    n = x.numel()
    expected = math.ceil(n * bits / 8) + 8 * math.ceil(n / 128)
    assert saved(lambda x: silu(x, bits=bits), x) == q_bytes(n, bits) == expected
    assert saved(lambda x: silu(x, bits=bits, group_size=64), x) == q_bytes(n, bits, 64)
    assert saved(F.silu, x) == n * 4  # plain PyTorch keeps the fp32 input


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_and_autocast(dtype):
    x = torch.randn(8, 256, dtype=dtype, requires_grad=True)
    g = torch.randn_like(x)
    y = silu(x, bits=8)
    assert y.dtype == dtype and torch.equal(y, F.silu(x))
    (got,) = torch.autograd.grad(y, x, g)
    (ref,) = torch.autograd.grad(F.silu(x), x, g)
    assert got.dtype == dtype and rel_err(got, ref) < 2e-2
    xf = torch.randn(8, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = silu(xf, bits=4), F.silu(xf)
    assert y.dtype == y_ref.dtype and torch.equal(y, y_ref)  # SiLU is not cast by autocast


def test_stochastic_rounding_mean_converges():
    torch.manual_seed(0)
    x = torch.randn(32, 256, requires_grad=True)
    g = torch.randn_like(x)
    (exact,) = torch.autograd.grad(F.silu(x), x, g)
    samples = torch.stack([torch.autograd.grad(silu(x, bits=4, stochastic=True), x, g)[0] for _ in range(32)])
    err1 = sum(rel_err(s, exact) for s in samples[:8]) / 8
    assert rel_err(samples[:16].mean(0), exact) <= 2 * err1 / math.sqrt(16)


def test_no_grad_empty_and_errors():
    with torch.no_grad():
        assert silu(torch.randn(3, 4)).grad_fn is None
    x = torch.randn(0, 5, requires_grad=True)
    assert torch.autograd.grad(silu(x).sum(), x)[0].shape == x.shape
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match="bits must be one of"):
        silu(x, bits=3)
    with pytest.raises(ValueError, match="group_size"):
        silu(x, group_size=100)
    with pytest.raises(TypeError, match="check_finite must be True or False"):
        silu(x, check_finite="no")
    with pytest.raises(TypeError, match="unsupported dtype torch.float64"):
        silu(x.double())
    with pytest.raises(RuntimeError, match="slimfit.silu: double backward"):
        torch.autograd.grad(silu(x).sum(), x, create_graph=True)


@pytest.mark.parametrize("into", ["input", "grad"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_reaches_the_gradient(into, value):
    """Guard (issue #30): wherever F.silu's gradient is NaN/Inf, slimfit's is too."""
    x0, g = torch.randn(4, 200, generator=torch.Generator().manual_seed(0)), torch.randn(4, 200)
    (x0 if into == "input" else g)[1, 7] = value
    grads = []
    for fn in (F.silu, lambda x: silu(x, bits=4)):
        x = x0.clone().requires_grad_()
        grads.append(torch.autograd.grad(fn(x), x, g))
    assert not nonfinite_missed(grads[1], grads[0])
