"""slimfit.autograd.gelu: exact forward, derivative of the chosen form at the dequantized input."""
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

from slimfit.autograd import gelu
from slimfit.kernels import dequantize, quantize


def _ffn_preactivations(seed=0):
    """GELU inputs as in a BERT FFN: BERT-like hidden states times a 768x3072 projection."""
    gen = torch.Generator().manual_seed(seed)
    x = bert_like_hidden(batch=1, seq=128, seed=seed)
    w = torch.randn(3072, 768, generator=gen) * 0.02
    return (x @ w.T).requires_grad_()


def _realistic_grad(h):
    """Upstream gradient of a regression through the FFN down-projection (coherent across tokens)."""
    gen = torch.Generator().manual_seed(1)
    w2 = torch.randn(768, 3072, generator=gen) * 0.02
    h = h.detach()
    target = F.gelu(h * 1.05) @ w2.T
    out = F.gelu(h) @ w2.T
    return (2.0 / out.numel()) * ((out - target) @ w2)  # d mse / d gelu(h)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 77), (2, 5, 128), (0, 16)])
def test_forward_exact_and_backward_is_exact_derivative_at_dequantized_input(approximate, bits, shape):
    x = (torch.randn(shape) * 2).requires_grad_()
    y = gelu(x, bits=bits, approximate=approximate)
    assert torch.equal(y, F.gelu(x, approximate=approximate))
    g = torch.randn_like(y)
    (got,) = torch.autograd.grad(y, x, g)
    # what backward must compute: PyTorch's GELU gradient at the dequantized input
    xq = dequantize(quantize(x.detach(), bits, 128)).requires_grad_()
    (expected,) = torch.autograd.grad(F.gelu(xq, approximate=approximate), xq, g)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bits, max_rel, min_cos", [(8, 5e-3, 0.99999), (4, 8e-2, 0.995), (2, 0.35, 0.94)])
def test_grad_error_realistic(approximate, bits, max_rel, min_cos):
    """BERT-like FFN pre-activations (std 0.6, outliers up to 12 from the outlier channels)
    with a regression gradient. GELU is elementwise, so rounding errors do not average out:
    the relative error is that of GELU' at the rounded inputs. Measured (both forms): 8-bit
    3.8e-3, 4-bit 6.4e-2 (cos 0.9979), 2-bit 0.29 (cos 0.960)."""
    h = _ffn_preactivations()
    g = _realistic_grad(h)
    (exact,) = torch.autograd.grad(F.gelu(h, approximate=approximate), h, g)
    (got,) = torch.autograd.grad(gelu(h, bits=bits, approximate=approximate), h, g)
    assert rel_err(got, exact) <= max_rel
    assert cos_sim(got, exact) >= min_cos


@pytest.mark.parametrize("bits, min_cos", [(8, 0.9999), (4, 0.99), (2, 0.9)])
def test_grad_error_random_gradient(bits, min_cos):
    """Independent random upstream gradient on N(0, 1) inputs (worst case for averaging).
    The derivative of GELU varies by at most ~1.1 per unit of input, so its error is at most
    ~1.1x the input's rms rounding error, range/(2**bits-1)/sqrt(12) with range ~5.2:
    8-bit 0.0065, 4-bit 0.11, 2-bit 0.55 relative to |gelu'| ~ 0.6 -> cos floors 0.9999, 0.99, 0.9
    (measured 0.99999, 0.998, 0.96)."""
    torch.manual_seed(0)
    x = torch.randn(64, 768, requires_grad=True)
    g = torch.randn_like(x)
    (exact,) = torch.autograd.grad(F.gelu(x), x, g)
    (got,) = torch.autograd.grad(gelu(x, bits=bits), x, g)
    assert cos_sim(got, exact) >= min_cos


def test_stochastic_rounding_converges():
    """Stochastic rounding makes the saved input unbiased; GELU' is not linear, so the mean
    gradient keeps a second-order bias ~ |gelu'''| * var(rounding) -- far below one sample's
    error. The error of the mean must shrink ~1/sqrt(n) until that floor."""
    torch.manual_seed(0)
    x = torch.randn(32, 256, requires_grad=True)
    g = torch.randn_like(x)
    (exact,) = torch.autograd.grad(F.gelu(x), x, g)
    samples = torch.stack([torch.autograd.grad(gelu(x, bits=4, stochastic=True), x, g)[0] for _ in range(64)])
    err1 = sum(rel_err(s, exact) for s in samples[:8]) / 8
    assert rel_err(samples[:4].mean(0), exact) <= 2 * err1 / math.sqrt(4)
    assert rel_err(samples[:16].mean(0), exact) <= 2 * err1 / math.sqrt(16)
    assert rel_err(samples.mean(0), exact) <= 0.25 * err1
    (near,) = torch.autograd.grad(gelu(x, bits=4), x, g)
    assert rel_err(samples.mean(0), exact) < rel_err(near, exact) / 2


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("shape", [(3, 77), (4, 128, 64), (1,), (0, 8)])
def test_bytes_saved(bits, shape):
    x = torch.randn(shape, requires_grad=True)
    n = x.numel()
    expected = math.ceil(n * bits / 8) + 8 * math.ceil(n / 128)
    assert saved(lambda x: gelu(x, bits=bits), x) == expected == q_bytes(n, bits)
    assert saved(lambda x: gelu(x, bits=bits, group_size=256), x) == q_bytes(n, bits, 256)
    assert saved(F.gelu, x) == n * 4  # plain PyTorch keeps the fp32 input


def test_noncontiguous_input():
    base = torch.randn(64, 96)
    x = base.t().requires_grad_()  # (96, 64), column-major
    xc = base.t().contiguous().requires_grad_()
    g = torch.randn(96, 64)
    y, yc = gelu(x, bits=8), gelu(xc, bits=8)
    # (PyTorch's own GELU rounds differently for strided and contiguous inputs)
    assert torch.equal(y, F.gelu(x)) and torch.equal(yc, F.gelu(xc))
    torch.testing.assert_close(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(yc, xc, g)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_and_autocast(dtype):
    x = torch.randn(8, 256, dtype=dtype, requires_grad=True)
    g = torch.randn_like(x)
    y = gelu(x, bits=8)
    assert y.dtype == dtype and torch.equal(y, F.gelu(x))
    (got,) = torch.autograd.grad(y, x, g)
    (ref,) = torch.autograd.grad(F.gelu(x), x, g)
    assert got.dtype == dtype and rel_err(got, ref) < 2e-2
    xf = torch.randn(8, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = gelu(xf, bits=4), F.gelu(xf)
    assert y.dtype == y_ref.dtype and torch.equal(y, y_ref)  # GELU is not cast by autocast


def test_empty_and_no_grad():
    x = torch.randn(0, 5, requires_grad=True)
    y = gelu(x)
    (gx,) = torch.autograd.grad(y.sum(), x)
    assert gx.shape == x.shape
    with torch.no_grad():
        z = gelu(torch.randn(3, 4))
    assert z.grad_fn is None


def test_errors_name_the_problem():
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match="bits must be one of"):
        gelu(x, bits=3)
    with pytest.raises(ValueError, match="approximate"):
        gelu(x, approximate="erf")
    with pytest.raises(ValueError, match="slimfit.gelu: bits must be one of"):  # 8.0: not slimfit.quantize's
        gelu(x, bits=8.0)
    with pytest.raises(TypeError, match="stochastic must be True or False"):
        gelu(x, stochastic=1)
    with pytest.raises(TypeError, match="unsupported dtype torch.float64"):
        gelu(x.double())
    with pytest.raises(RuntimeError, match="slimfit.gelu: double backward"):
        torch.autograd.grad(gelu(x).sum(), x, create_graph=True)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("into", ["input", "grad"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_reaches_the_gradient(approximate, into, value):
    """Guard (issue #30): wherever F.gelu's gradient is NaN/Inf, slimfit's is too (a group holding a
    non-finite input dequantizes to non-finite values; a non-finite upstream gradient passes through)."""
    x0, g = torch.randn(4, 200, generator=torch.Generator().manual_seed(0)), torch.randn(4, 200)
    (x0 if into == "input" else g)[1, 7] = value
    grads = []
    for fn in (lambda x: F.gelu(x, approximate=approximate), lambda x: gelu(x, bits=4, approximate=approximate)):
        x = x0.clone().requires_grad_()
        grads.append(torch.autograd.grad(fn(x), x, g))
    assert not nonfinite_missed(grads[1], grads[0])
