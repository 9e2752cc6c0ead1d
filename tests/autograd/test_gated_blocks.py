"""The gated product's backward (SwiGLU, GeGLU) a block of elements at a time: every gradient bit for bit the
whole-tensor backward's, with fp32 temporaries of a block, not of the tensor."""
import sys

import pytest
import torch
from _grad_utils import single_thread  # noqa: F401  (autouse fixture)

from slimfit import step_memory
from slimfit.autograd.geglu import geglu
from slimfit.autograd.silu import swiglu
from slimfit.kernels import quantize

silu_module = sys.modules["slimfit.autograd.silu"]   # the module (slimfit.autograd.silu is also the function)


def _grads(fn, gate, up, g, needs=(True, True)):
    gate = gate.detach().requires_grad_(needs[0])
    up = up.detach().requires_grad_(needs[1])
    y = fn(gate, up)
    inputs = [t for t in (gate, up) if t.requires_grad]
    return torch.autograd.grad(y, inputs, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fn", [lambda a, b: swiglu(a, b, bits=4), lambda a, b: swiglu(a, b, bits=8, up_bits=4),
                                lambda a, b: geglu(a, b)], ids=["swiglu4", "swiglu8-4", "geglu"])
@pytest.mark.parametrize("shape", [(3, 5, 200), (7, 333), (1, 4096)])
@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)])
def test_blocks_give_the_whole_backwards_bits(monkeypatch, dtype, fn, shape, needs):
    gen = torch.Generator().manual_seed(0)
    gate = (torch.randn(shape, generator=gen) * 3).to(dtype)
    up = torch.randn(shape, generator=gen).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    monkeypatch.setattr(silu_module, "GATED_BLOCK_ELEMENTS", 10**9)   # one block: the whole-tensor path
    whole = _grads(fn, gate, up, g, needs)
    monkeypatch.setattr(silu_module, "GATED_BLOCK_ELEMENTS", 256)     # blocks of two groups, a ragged last one
    blocked = _grads(fn, gate, up, g, needs)
    assert len(whole) == len(blocked) == sum(needs)
    for a, b in zip(whole, blocked):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           b.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_a_strided_gradient_keeps_the_whole_tensor_path(monkeypatch):
    monkeypatch.setattr(silu_module, "GATED_BLOCK_ELEMENTS", 256)
    gate, up = torch.randn(64, 40, requires_grad=True), torch.randn(64, 40, requires_grad=True)
    g = torch.randn(40, 64).t()   # not contiguous
    assert not silu_module._in_blocks(quantize(gate.detach(), 4), quantize(up.detach(), 4), g)
    got = torch.autograd.grad(swiglu(gate, up), [gate, up], g)
    monkeypatch.setattr(silu_module, "GATED_BLOCK_ELEMENTS", 10**9)
    expected = torch.autograd.grad(swiglu(gate, up), [gate, up], g)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_elements_of_a_quantized_tensor_are_views_that_dequantize_to_the_whole():
    from slimfit.kernels import dequantize

    x = torch.randn(5, 300)
    for bits in (2, 4, 8):
        q = quantize(x, bits, 128)
        whole = dequantize(q).reshape(-1)
        for start, end in ((0, 128), (128, 1000), (1408, 1500)):
            part = q.elements(start, end)
            assert part.codes.data_ptr() >= q.codes.data_ptr() and part.codes._base is not None
            assert torch.equal(dequantize(part), whole[start:end])
    with pytest.raises(ValueError, match="multiple of group_size"):
        q.elements(100, 200)


def test_a_bf16_backwards_peak_holds_a_blocks_fp32_temporaries(monkeypatch):
    """A bf16 gated product of 2**21 elements: backward's peak above its inputs' is the two bf16 gradients and a
    block's temporaries, where the whole-tensor path held three fp32 tensors of the whole size."""
    n = 2**21
    gate = torch.randn(1, 512, n // 512).to(torch.bfloat16).requires_grad_()
    up = torch.randn(1, 512, n // 512).to(torch.bfloat16).requires_grad_()

    def step_peak(block):
        monkeypatch.setattr(silu_module, "GATED_BLOCK_ELEMENTS", block)
        holder = torch.nn.Module()
        holder.gate, holder.up = torch.nn.Parameter(gate.detach().clone()), torch.nn.Parameter(up.detach().clone())
        run = step_memory.measure_step(holder, lambda: swiglu(holder.gate, holder.up).float().sum(), None)
        return run.total - run.resident

    whole, blocked = step_peak(10**9), step_peak(2**18)
    bf16_full, fp32_full = 2 * n, 4 * n
    assert whole - blocked >= 2 * fp32_full - bf16_full, (whole, blocked)
