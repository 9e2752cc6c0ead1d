"""slimfit.autograd.geglu: gelu(gate) * up exact in forward; gate and up saved quantized; both gradients
exact functions of the dequantized values; the saved bytes are the two codes."""
import pytest
import torch
import torch.nn.functional as F
from _grad_utils import q_bytes, saved  # noqa: F401

from slimfit.autograd.geglu import geglu
from slimfit.kernels import dequantize, quantize


def _plain(gate, up, approximate):
    return F.gelu(gate, approximate=approximate) * up


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("bits, up_bits", [(8, None), (4, None), (4, 8)])
@pytest.mark.parametrize("shape", [(1,), (3, 77), (2, 5, 128)])
def test_forward_exact_and_backward_at_dequantized_values(approximate, bits, up_bits, shape):
    gate = (torch.randn(shape) * 2).requires_grad_()
    up = torch.randn(shape).requires_grad_()
    y = geglu(gate, up, approximate=approximate, bits=bits, up_bits=up_bits)
    assert torch.equal(y, _plain(gate, up, approximate))
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [gate, up], g)
    gq = dequantize(quantize(gate.detach(), bits, 128)).requires_grad_()
    uq = dequantize(quantize(up.detach(), up_bits or bits, 128)).requires_grad_()
    expected = torch.autograd.grad(_plain(gq, uq, approximate), [gq, uq], g)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-7)


def test_saves_the_two_codes_only():
    gate, up = torch.randn(4, 256, requires_grad=True), torch.randn(4, 256, requires_grad=True)
    bytes_ = saved(lambda a, b: geglu(a, b, bits=4), gate, up)
    assert bytes_ == 2 * q_bytes(1024, 4)
    assert saved(lambda a, b: _plain(a, b, "tanh"), gate, up) >= 3 * 1024 * 4


def test_matches_gemma_mlp():
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    cfg = pytest.importorskip("transformers").GemmaConfig(hidden_size=32, intermediate_size=80)
    torch.manual_seed(0)
    mlp = gemma.GemmaMLP(cfg)
    x = torch.randn(2, 5, 32)
    ours = mlp.down_proj(geglu(mlp.gate_proj(x), mlp.up_proj(x), approximate="tanh", bits=8))
    assert torch.equal(ours, mlp(x))


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="approximate"):
        geglu(torch.randn(3), torch.randn(3), approximate="erf")
    with pytest.raises(ValueError, match="mismatched shapes"):
        geglu(torch.randn(3), torch.randn(4))
