"""slimfit.autograd.row_scale: y * w[..., None] exact; grad_y exact; grad_w at the dequantized rows (error
bounded by the format); the rows saved as codes only while w needs a gradient."""
import pytest
import torch
from _grad_utils import q_bytes, rel_err, saved

from slimfit.autograd import row_scale
from slimfit.kernels import dequantize, quantize


def _inputs(shape, y_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(shape, generator=gen).to(y_dtype).requires_grad_()
    w = torch.rand(shape[:-1], generator=gen).requires_grad_()   # routing weights in (0, 1), fp32
    g = torch.randn(shape, generator=gen)
    return y, w, g


@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16])
def test_in_full_equals_pytorch_bit_for_bit(y_dtype):
    """bits=None, bf16 rows with fp32 weights too (PyTorch's promotion: an fp32 product)."""
    y, w, g = _inputs((9, 40), y_dtype)
    out = row_scale(y, w, bits=None)
    ref = y * w[..., None]
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    got = torch.autograd.grad(out, [y, w], g.to(out.dtype))
    exp = torch.autograd.grad(ref, [y, w], g.to(ref.dtype))
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, exp))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", [(7, 256), (2, 5, 384)])
def test_compressed_rows_give_the_gradient_at_the_dequantized_point(bits, shape):
    y, w, g = _inputs(shape)
    out = row_scale(y, w, bits=bits)
    assert torch.equal(out, y * w[..., None])
    gy, gw = torch.autograd.grad(out, [y, w], g)
    assert torch.equal(gy, g * w.detach()[..., None])
    yq = dequantize(quantize(y.detach(), bits, 128))
    torch.testing.assert_close(gw, (g * yq).sum(-1), rtol=1e-5, atol=1e-6)
    assert rel_err(gw, (g * y.detach()).sum(-1)) < (0.02 if bits == 8 else 0.3)


def test_saved_bytes():
    y, w, _ = _inputs((4, 256))
    w_bytes = 4 * 4
    assert saved(lambda a, b: row_scale(a, b, bits=8), y, w) == q_bytes(1024, 8) + w_bytes
    assert saved(lambda a, b: a * b[..., None], y, w) == 1024 * 4 + w_bytes   # PyTorch keeps the rows in full
    w_fixed = w.detach()
    assert saved(lambda a: row_scale(a, w_fixed, bits=8), y) == w_bytes    # no weight gradient: no rows
    y_fixed = y.detach()
    assert saved(lambda b: row_scale(y_fixed, b, bits=8), w) == q_bytes(1024, 8)


def test_bad_arguments_name_the_problem():
    y, w, _ = _inputs((4, 8))
    with pytest.raises(ValueError, match="one weight per row"):
        row_scale(y, w[:3])
    with pytest.raises(ValueError, match="bits"):
        row_scale(y, w, bits=3)
    with pytest.raises((TypeError, ValueError), match="float"):
        row_scale(y, torch.ones(4, dtype=torch.long))
