"""QuickGELU (x * sigmoid(1.702 x), CLIP's activation) through slimfit's GELU: forward bit-identical to
transformers' module, backward the exact derivative at the dequantized input, and patched by type."""
import pytest
import torch

import slimfit
from slimfit.autograd import gelu
from slimfit.kernels import dequantize, quantize

activations = pytest.importorskip("transformers.activations")


@pytest.mark.parametrize("bits", [8, 4])
def test_quick_gelu_forward_exact_backward_at_dequantized_input(bits):
    x = torch.randn(3, 257, generator=torch.Generator().manual_seed(0)).requires_grad_()
    g = torch.randn(3, 257, generator=torch.Generator().manual_seed(1))
    y = gelu(x, bits=bits, approximate="quick")
    assert torch.equal(y, activations.QuickGELUActivation()(x))
    (got,) = torch.autograd.grad(y, x, g)
    xq = dequantize(quantize(x.detach(), bits, 128)).requires_grad_()
    (want,) = torch.autograd.grad(activations.QuickGELUActivation()(xq), xq, g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_quick_gelu_module_is_patched():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), activations.QuickGELUActivation(), torch.nn.Linear(16, 4))
    slimfit.patch(model, slimfit.SlimFitConfig.paper())
    assert model.slimfit_summary.counts().get("gelu[4-bit input (quick)]") == 1
    x = torch.randn(5, 8)
    with torch.no_grad():
        plain = model(x)
    slimfit.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(x), plain)
