"""slimfit.kernels on bf16 input: every backend that serves the CPU gives the reference's result bit for bit
(the dispatched C++ kernels and the pure-PyTorch specification), results come back in bf16 where the op
returns values, and a dtype the kernels do not take is refused with an error naming the dtype and the fix."""
from __future__ import annotations

import pytest
import torch

from slimfit.kernels import reference
from slimfit.kernels.qmaps import signed

X = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 3


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_dequantize_bf16_equal_reference(bits, stochastic):
    got = torch.ops.slimfit.quantize(X, bits, 128, stochastic, 7)
    ref = reference.quantize(X, bits, 128, stochastic, 7)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    out = torch.ops.slimfit.dequantize(*got, bits, 128, list(X.shape), torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, reference.dequantize(*ref, bits, 128, list(X.shape), torch.bfloat16))
    if bits == 8 and not stochastic:   # round to nearest: within half a step of the group (+ bf16's rounding)
        scale = got[1].repeat_interleave(128)[: X.numel()].view(X.shape)
        assert ((out.float() - X.float()).abs() <= scale / 2 + X.float().abs() * 2.0 ** -8).all()


def test_topk_and_dropout_bf16_equal_reference():
    got, ref = torch.ops.slimfit.topk_prune(X, 30, True), reference.topk_prune(X, 30, True)
    assert got[0].dtype == torch.bfloat16 and all(torch.equal(a, b) for a, b in zip(got, ref))
    assert torch.equal(torch.ops.slimfit.topk_restore(*got, 300), reference.topk_restore(*ref, 300))
    out = torch.ops.slimfit.seeded_dropout(X, 0.1, 3)
    assert out.dtype == torch.bfloat16 and torch.equal(out, reference.seeded_dropout(X, 0.1, 3))


def test_blockwise_bf16_equal_reference():
    qmap = signed(8)
    got = torch.ops.slimfit.quantize_blockwise(X, qmap, 128)
    ref = reference.quantize_blockwise(X, qmap, 128)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    out = torch.ops.slimfit.dequantize_blockwise(*got, qmap, 128, list(X.shape), torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, reference.dequantize_blockwise(*ref, qmap, 128, list(X.shape), torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_unsupported_dtype_refused_with_its_name_and_the_fix(dtype):
    with pytest.raises((TypeError, RuntimeError), match="unsupported dtype .*use float32, float16 or bfloat16"):
        torch.ops.slimfit.quantize(X.to(dtype), 8, 128, False, 0)
