"""slimfit.autograd.grouped_linear: rows sorted by expert through their expert's weight. Output and gradients
bit-identical to PyTorch's grouped_mm under autograd (with the rows gathered as transformers gathers them);
a frozen weight saves nothing; a trained one keeps the gather's source once, in full or quantized."""
import importlib

import pytest
import torch
import torch.nn.functional as F
from _grad_utils import q_bytes, rel_err, saved

from slimfit.autograd.grouped_linear import grouped_linear
from slimfit.kernels import dequantize, quantize

TOKENS, K, EXPERTS, IN, OUT = 40, 2, 5, 128, 96


def _routed(seed=0, empty_expert=True):
    """Hidden states, weights, and the token-expert pairs sorted by expert (expert 3 gets none)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, IN, generator=gen).requires_grad_()
    w = torch.randn(EXPERTS, OUT, IN, generator=gen).requires_grad_()
    choices = [e for e in range(EXPERTS) if not (empty_expert and e == 3)]
    index = torch.stack([torch.tensor(choices)[torch.randperm(len(choices), generator=gen)[:K]]
                         for _ in range(TOKENS)])
    expert, order = torch.sort(index.reshape(-1))
    offsets = torch.cumsum(torch.bincount(expert, minlength=EXPERTS), 0).to(torch.int32)
    g = torch.randn(TOKENS * K, OUT, generator=gen)
    return x, w, offsets, order // K, g


def _reference(x, w, offsets, gather):
    return F.grouped_mm(x[gather], w.transpose(-2, -1), offs=offsets)


def test_in_full_equals_pytorch_grouped_mm_bit_for_bit():
    x, w, offsets, gather, g = _routed()
    out = grouped_linear(x, w, offsets, gather=gather)
    ref = _reference(x, w, offsets, gather)
    assert torch.equal(out, ref)
    got = torch.autograd.grad(out, [x, w], g)
    exp = torch.autograd.grad(ref, [x, w], g)
    assert all(torch.equal(a, b) for a, b in zip(got, exp))
    assert torch.equal(got[1][3], torch.zeros(OUT, IN))   # an expert no token reached: no gradient


def test_the_models_own_grouped_gemm_gives_its_own_output():
    """With transformers' grouped linear as `mm`, the output is the one its experts forward computes."""
    moe = pytest.importorskip("transformers.integrations.moe")
    x, w, offsets, gather, g = _routed(1)
    mm = lambda rows, weight_t, offs: moe._grouped_linear(rows, weight_t, offs, is_transposed=True)  # noqa: E731
    out = grouped_linear(x, w, offsets, gather=gather, mm=mm)
    ref = moe._grouped_linear(x[gather], w, offsets)
    assert torch.equal(out, ref)
    got = torch.autograd.grad(out, [x, w], g)
    exp = torch.autograd.grad(ref, [x, w], g)
    assert all(torch.equal(a, b) for a, b in zip(got, exp))


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_source_gives_the_weight_gradient_at_the_dequantized_point(bits):
    x, w, offsets, gather, g = _routed(2)
    out = grouped_linear(x, w, offsets, gather=gather, input_bits=bits)
    assert torch.equal(out, _reference(x, w, offsets, gather))
    gx, gw = torch.autograd.grad(out, [x, w], g)
    ref_gx, ref_gw = torch.autograd.grad(_reference(x, w, offsets, gather), [x, w], g)
    assert torch.equal(gx, ref_gx)                       # the input gradient needs the weight only
    xq = dequantize(quantize(x.detach(), bits, 128)).requires_grad_()
    at_codes = torch.autograd.grad(_reference(xq, w, offsets, gather), [w], g)[0]
    torch.testing.assert_close(gw, at_codes, rtol=1e-5, atol=1e-5)
    assert rel_err(gw, ref_gw) < (0.02 if bits == 8 else 0.3)


def test_without_gather_the_rows_are_the_input():
    x, w, offsets, _, g = _routed(3)
    rows = x.detach()[: TOKENS].repeat(K, 1).requires_grad_()
    out = grouped_linear(rows, w, offsets)
    ref = F.grouped_mm(rows, w.transpose(-2, -1), offs=offsets)
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out, [rows, w], g),
                                                torch.autograd.grad(ref, [rows, w], g)))


def test_saved_bytes():
    x, w, offsets, gather, _ = _routed()
    # the weight (a plain tensor here, a parameter in a model) for the input gradient, the int indices
    index_bytes = w.numel() * 4 + offsets.numel() * 4 + gather.numel() * 8
    source = TOKENS * IN * 4
    assert saved(lambda a, b: grouped_linear(a, b, offsets, gather=gather), x, w) == source + index_bytes
    assert saved(lambda a, b: grouped_linear(a, b, offsets, gather=gather, input_bits=8), x, w) == (
        q_bytes(TOKENS * IN, 8) + index_bytes)
    # PyTorch keeps the gathered rows, K per token
    assert saved(lambda a, b: _reference(a, b, offsets, gather), x, w) >= K * source
    frozen = w.detach()
    assert saved(lambda a: grouped_linear(a, frozen, offsets, gather=gather), x) == index_bytes  # no activation


def test_bad_arguments_name_the_problem():
    x, w, offsets, gather, _ = _routed()
    with pytest.raises(ValueError, match="weight"):
        grouped_linear(x, w[0], offsets)
    with pytest.raises(ValueError, match="offsets"):
        grouped_linear(x, w, offsets[:-1])
    with pytest.raises(ValueError, match="offsets"):
        grouped_linear(x, w, offsets.float())
    with pytest.raises(TypeError):
        grouped_linear(x.long(), w, offsets)
    with pytest.raises(ValueError, match="bits"):
        grouped_linear(x, w, offsets, input_bits=3)


def test_weight_gradient_without_pytorchs_grouped_mm(monkeypatch):
    """Where grouped_mm cannot run (no kernel for the device or dtype), one mm per expert: the same values."""
    module = importlib.import_module("slimfit.autograd.grouped_linear")   # the package exports the function

    x, w, offsets, gather, g = _routed(4)
    rows = x.detach()[gather]
    expected = module.grouped_weight_grad(rows, g, offsets)

    def refuse(*args, **kwargs):
        raise NotImplementedError("no kernel here")

    monkeypatch.setattr(module.F, "grouped_mm", refuse)
    torch.testing.assert_close(module.grouped_weight_grad(rows, g, offsets), expected, rtol=1e-5, atol=1e-5)
