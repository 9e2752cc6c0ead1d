"""slimfit.autograd.dropout: a seed (0 bytes) or a 1-bit mask is all backward keeps."""
import math

import pytest
import torch
import torch.nn.functional as F
from _grad_utils import saved, single_thread  # noqa: F401  (single_thread: autouse fixture)

from slimfit.autograd import dropout
from slimfit.kernels import dropout_mask, seeded_dropout

MODES = ["seed", "bitmask"]


def _expected(x, p, seed):
    keep = dropout_mask(x, p, seed)
    return torch.where(keep, x.float() * torch.tensor(1.0 / (1.0 - p)), torch.zeros(())).to(x.dtype), keep


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("shape", [(7,), (4, 33), (2, 3, 128), (0, 5)])
def test_forward_and_backward_exact(mode, p, shape):
    x = torch.randn(shape, requires_grad=True)
    y = dropout(x, p, mode=mode, seed=1234)
    y_ref, keep = _expected(x.detach(), p, 1234)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    g_ref, _ = _expected(g, p, 1234)
    assert torch.equal(gx, g_ref)
    assert torch.equal(gx, torch.where(keep, g * (1.0 / (1.0 - p)), torch.zeros(())))


def test_modes_agree_and_seeds_come_from_torch_generator():
    x = torch.randn(16, 64, requires_grad=True)
    torch.manual_seed(7)
    a = dropout(x, 0.3, mode="seed")
    torch.manual_seed(7)
    b = dropout(x, 0.3, mode="bitmask")
    assert torch.equal(a, b)
    c = dropout(x, 0.3)
    assert not torch.equal(a, c)  # a fresh seed per call
    g = torch.randn_like(a)
    assert torch.equal(torch.autograd.grad(a, x, g)[0], torch.autograd.grad(b, x, g)[0])


@pytest.mark.parametrize("mode", MODES)
def test_drop_rate_and_unbiased_output(mode):
    x = torch.ones(256, 1024, requires_grad=True)
    p = 0.2
    y = dropout(x, p, mode=mode)
    dropped = float((y == 0).float().mean())
    n = x.numel()
    assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / n)
    assert abs(float(y.detach().mean()) - 1.0) < 5 * math.sqrt(p / (1 - p) / n)


@pytest.mark.parametrize("shape", [(4, 33), (2, 3, 128), (1,), (0, 8), (1000, 77)])
def test_bytes_saved(shape):
    x = torch.randn(shape, requires_grad=True)
    n = x.numel()
    assert saved(lambda x: dropout(x, 0.1, mode="seed"), x) == 0
    assert saved(lambda x: dropout(x, 0.1, mode="bitmask"), x) == math.ceil(n / 8)
    if n:  # plain PyTorch keeps the mask: on the CPU as a float tensor (4 bytes per element)
        assert saved(lambda x: F.dropout(x, 0.1), x) >= n


def test_eval_and_p_zero_are_identity_p_one_zeros():
    x = torch.randn(4, 8, requires_grad=True)
    assert dropout(x, 0.5, training=False) is x
    assert dropout(x, 0.0) is x
    for mode in MODES:
        y = dropout(x, 1.0, mode=mode)
        assert torch.equal(y, torch.zeros_like(x))
        (gx,) = torch.autograd.grad(y.sum(), x)
        assert torch.equal(gx, torch.zeros_like(x))


@pytest.mark.parametrize("mode", MODES)
def test_noncontiguous_input(mode):
    base = torch.randn(64, 32)
    x = base.t().requires_grad_()
    xc = base.t().contiguous().requires_grad_()
    y, yc = dropout(x, 0.25, mode=mode, seed=5), dropout(xc, 0.25, mode=mode, seed=5)
    assert torch.equal(y, yc)
    g = torch.randn(64, 32).t()  # a non-contiguous upstream gradient too
    assert torch.equal(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(yc, xc, g)[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_half_dtypes_and_autocast(dtype, mode):
    x = torch.randn(8, 64, dtype=dtype, requires_grad=True)
    y = dropout(x, 0.1, mode=mode, seed=3)
    assert y.dtype == dtype and torch.equal(y, seeded_dropout(x.detach(), 0.1, 3))
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert gx.dtype == dtype
    xf = torch.randn(8, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dropout(xf, 0.1, mode=mode).dtype == F.dropout(xf, 0.1).dtype == torch.float32


def test_errors_name_the_problem():
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match="p must be in"):
        dropout(x, 1.5)
    with pytest.raises(ValueError, match="mode must be"):
        dropout(x, 0.1, mode="mask")
    with pytest.raises(TypeError, match="training must be True or False"):  # "no" is truthy: dropout on
        dropout(x, 0.1, training="no")
    with pytest.raises(TypeError, match="unsupported dtype torch.float64"):
        dropout(x.double(), 0.1)
    with pytest.raises(RuntimeError, match="slimfit.dropout: double backward"):
        torch.autograd.grad(dropout(x, 0.1).sum(), x, create_graph=True)
