"""slimfit.autograd.layer_scale: x * w exact; grad_x exact; grad_w at the dequantized x (error bounded by
the format); x saved as codes only while w trains; nothing saved when w is frozen."""
import pytest
import torch
from _grad_utils import q_bytes, rel_err, saved  # noqa: F401

from slimfit.autograd.layer_scale import layer_scale
from slimfit.kernels import dequantize, quantize


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", [(5, 16), (2, 7, 384)])
def test_forward_exact_and_gradients(bits, shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).requires_grad_()
    w = (torch.rand(shape[-1], generator=gen) * 1e-5 + 1e-5).requires_grad_()  # DINOv2's layerscale_value
    g = torch.randn(shape, generator=gen)
    y = layer_scale(x, w, bits=bits)
    assert torch.equal(y, x * w)
    gx, gw = torch.autograd.grad(y, [x, w], g)
    assert torch.equal(gx, g * w)
    xq = dequantize(quantize(x.detach(), bits, 128))
    torch.testing.assert_close(gw, (g * xq).reshape(-1, shape[-1]).sum(0), rtol=1e-5, atol=1e-6)
    exact = (g * x.detach()).reshape(-1, shape[-1]).sum(0)
    assert rel_err(gw, exact) < (0.02 if bits == 8 else 0.3)


def test_saved_bytes():
    x = torch.randn(4, 256, requires_grad=True)
    w = torch.nn.Parameter(torch.ones(256))  # a parameter: not an activation (the measure excludes it)
    assert saved(lambda a: layer_scale(a, w, bits=8), x) == q_bytes(1024, 8)
    w.requires_grad_(False)
    assert saved(lambda a: layer_scale(a, w, bits=8), x) == 0  # the weight is a parameter, x not needed
    w.requires_grad_(True)
    assert saved(lambda a: a * w, x) == 1024 * 4  # PyTorch keeps x in full


def test_shape_errors():
    with pytest.raises(ValueError, match="1-D"):
        layer_scale(torch.randn(3, 4), torch.ones(3))
