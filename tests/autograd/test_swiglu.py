"""slimfit.autograd.swiglu: silu(gate) * up exact in forward; gate and up saved quantized; both
gradients exact functions of the dequantized values."""
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

from slimfit.autograd.silu import swiglu
from slimfit.kernels import dequantize, quantize


def _plain(gate, up):
    return F.silu(gate) * up  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)


def _mlp_case(seed=0):
    """gate/up pre-activations of a SwiGLU MLP (BERT-like hidden states with outlier channels, 768 ->
    2048) and the gradient of a regression through the down projection (coherent across tokens)."""
    gen = torch.Generator().manual_seed(seed)
    x = bert_like_hidden(batch=1, seq=128, seed=seed)
    wg = torch.randn(2048, 768, generator=gen) * 0.03
    wu = torch.randn(2048, 768, generator=gen) * 0.03
    wd = torch.randn(768, 2048, generator=gen) * 0.02
    gate, up = (x @ wg.T).requires_grad_(), (x @ wu.T).requires_grad_()
    out = _plain(gate, up).detach() @ wd.T
    target = _plain(gate.detach() * 1.05, up.detach()) @ wd.T
    g = (2.0 / out.numel()) * ((out - target) @ wd)
    return gate, up, g


@pytest.mark.parametrize("bits, up_bits", [(8, None), (4, None), (2, None), (4, 8)])
@pytest.mark.parametrize("shape", [(1,), (3, 77), (2, 5, 128), (0, 16)])
def test_forward_exact_and_backward_at_dequantized_values(bits, up_bits, shape):
    gate = (torch.randn(shape) * 2).requires_grad_()
    up = torch.randn(shape).requires_grad_()
    y = swiglu(gate, up, bits=bits, up_bits=up_bits)
    assert torch.equal(y, _plain(gate, up))
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [gate, up], g)
    gq = dequantize(quantize(gate.detach(), bits, 128)).requires_grad_()
    uq = dequantize(quantize(up.detach(), up_bits or bits, 128)).requires_grad_()
    expected = torch.autograd.grad(_plain(gq, uq), [gq, uq], g)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-7)


def test_matches_llama_mlp():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    cfg = pytest.importorskip("transformers").LlamaConfig(hidden_size=32, intermediate_size=80)
    torch.manual_seed(0)
    mlp = llama.LlamaMLP(cfg)
    x = torch.randn(2, 5, 32, requires_grad=True)
    y = mlp.down_proj(swiglu(mlp.gate_proj(x), mlp.up_proj(x), bits=4))
    assert torch.equal(y, mlp(x))


@pytest.mark.parametrize("bits, gate_rel, up_rel, min_cos", [(8, 7e-3, 2e-3, 0.9999), (4, 0.11, 0.025, 0.994)])
def test_grad_error_realistic(bits, gate_rel, up_rel, min_cos):
    """Measured: 8-bit d_gate 4.9e-3, d_up 9.4e-4; 4-bit d_gate 8.3e-2 (cos 0.9966), d_up 1.6e-2
    (cos 0.99987). d_up = g·silu(gate~) feels only gate's rounding (through silu, slope <= 1.1);
    d_gate = g·up~·silu'(gate~) feels both, like GELU's gradient at 4 bits (6.4e-2) plus up's rounding."""
    gate, up, g = _mlp_case()
    exact = torch.autograd.grad(_plain(gate, up), [gate, up], g)
    got = torch.autograd.grad(swiglu(gate, up, bits=bits), [gate, up], g)
    assert rel_err(got[0], exact[0]) <= gate_rel
    assert rel_err(got[1], exact[1]) <= up_rel
    assert min(cos_sim(a, e) for a, e in zip(got, exact)) >= min_cos


@pytest.mark.parametrize("bits, min_cos", [(8, 0.9999), (4, 0.99), (2, 0.8)])
def test_grad_error_random_gradient(bits, min_cos):
    """N(0, 1) gate and up, independent gradient. Measured cos (d_gate, d_up): 8-bit 0.99998 /
    0.99998, 4-bit 0.9929 / 0.9947, 2-bit 0.855 / 0.890."""
    torch.manual_seed(0)
    gate = torch.randn(64, 768, requires_grad=True)
    up = torch.randn(64, 768, requires_grad=True)
    g = torch.randn_like(gate)
    exact = torch.autograd.grad(_plain(gate, up), [gate, up], g)
    got = torch.autograd.grad(swiglu(gate, up, bits=bits), [gate, up], g)
    assert min(cos_sim(a, e) for a, e in zip(got, exact)) >= min_cos


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", [(3, 77), (4, 128, 96), (1,)])
def test_bytes_saved(bits, shape):
    """gate and up quantized: 2·q(N, b, G) against plain PyTorch's three full tensors (gate for
    SiLU, silu(gate) and up for the product); when only up needs a gradient, gate alone."""
    gate = torch.randn(shape, requires_grad=True)
    up = torch.randn(shape, requires_grad=True)
    n = gate.numel()
    assert saved(lambda a, b: swiglu(a, b, bits=bits), gate, up) == 2 * q_bytes(n, bits)
    assert saved(lambda a, b: swiglu(a, b, bits=4, up_bits=8), gate, up) == q_bytes(n, 4) + q_bytes(n, 8)
    assert saved(lambda a, b: swiglu(a, b, bits=bits), gate.detach(), up) == q_bytes(n, bits)
    assert saved(_plain, gate, up) == 3 * n * 4


def test_bf16_and_autocast():
    gate = torch.randn(8, 256, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(8, 256, dtype=torch.bfloat16, requires_grad=True)
    y = swiglu(gate, up, bits=8)
    assert y.dtype == torch.bfloat16 and torch.equal(y, _plain(gate, up))
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [gate, up], g)
    ref = torch.autograd.grad(_plain(gate, up), [gate, up], g)
    for a, r in zip(got, ref):
        assert a.dtype == torch.bfloat16 and rel_err(a, r) < 2e-2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = torch.randn(4, 64, requires_grad=True), torch.randn(4, 64, requires_grad=True)
        assert torch.equal(swiglu(a, b), _plain(a, b))


def test_errors_and_no_grad():
    gate, up = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match="mismatched shapes"):
        swiglu(gate, up[:, :4])
    with pytest.raises(ValueError, match="up_bits must be one of"):
        swiglu(gate, up, up_bits=3)
    with pytest.raises(ValueError, match="different devices .*up on meta.*move them to one device"):
        swiglu(gate, torch.randn(4, 8, device="meta", requires_grad=True))
    with pytest.raises(TypeError, match="stochastic must be True or False"):
        swiglu(gate, up, stochastic="no")
    with pytest.raises(TypeError, match="unsupported dtype torch.float64"):
        swiglu(gate.double(), up.double())
    with pytest.raises(RuntimeError, match="slimfit.swiglu: double backward"):
        torch.autograd.grad(swiglu(gate, up).sum(), gate, create_graph=True)
    with torch.no_grad():
        assert swiglu(gate, up).grad_fn is None


@pytest.mark.parametrize("into", ["gate", "up", "grad"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)])
def test_nonfinite_reaches_every_gradient(into, value, needs):
    """Guard (issue #30): wherever the gradients of F.silu(gate) * up are NaN/Inf, slimfit's are too."""
    gen = torch.Generator().manual_seed(0)
    gate0, up0, g = (torch.randn(4, 200, generator=gen) for _ in range(3))
    {"gate": gate0, "up": up0, "grad": g}[into][1, 7] = value
    grads = []
    for fn in (lambda a, b: F.silu(a) * b, lambda a, b: swiglu(a, b, bits=4)):
        gate, up = gate0.clone().requires_grad_(needs[0]), up0.clone().requires_grad_(needs[1])
        grads.append(torch.autograd.grad(fn(gate, up), [t for t in (gate, up) if t.requires_grad], g))
    assert not nonfinite_missed(grads[1], grads[0])
