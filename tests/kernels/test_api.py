"""The user-facing wrappers of slimfit.kernels (api.py) on CPU tensors: the named structures they
return, their argument errors, check_finite. (The ops under them, on every backend: test_op_*.py.)"""
import math

import pytest
import torch
from _backends import gen, randn

from slimfit import kernels as K


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_round_trips_keep_shape_and_dtype(dtype):
    x = randn((3, 77), dtype)
    q = K.quantize(x, 4, 64, stochastic=True, seed=3)
    assert (q.shape, q.dtype, q.bits, q.group_size) == ((3, 77), dtype, 4, 64)
    assert q.nbytes == q.codes.numel() + 8 * q.scale.numel()
    y = K.dequantize(q)
    assert y.shape == x.shape and y.dtype == dtype
    assert K.dequantize(q, torch.float32).dtype == torch.float32
    assert torch.equal(K.dequantize(K.QuantizedTensor.from_parts(q.tensors(), q.meta())), y)
    p = K.topk_prune(x, ratio=0.1)
    assert p.values.shape == (3, 8) and p.row_length == 77
    assert torch.equal(K.topk_restore(p), torch.zeros_like(x).scatter(-1, p.indices.long(), p.values))
    m = torch.rand(3, 5, generator=gen(1)) > 0.5
    assert torch.equal(K.unpack_bits(K.pack_bits(m), (3, 5)), m)
    assert torch.equal(K.seeded_dropout(x, 0.3, 5), torch.ops.slimfit.seeded_dropout(x, 0.3, 5))
    assert torch.equal(K.dropout_mask(x, 0.3, 5), torch.ops.slimfit.dropout_mask(x, 0.3, 5))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=str)
def test_non_finite_input_raises_when_checked(bad):
    x = randn((300,))
    x[257] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        K.quantize(x, 8, 128, check_finite=True)
    with pytest.raises(ValueError, match="NaN or Inf"):
        K.topk_prune(x.view(3, 100), k=3, check_finite=True)
    K.quantize(x, 8, 128)  # off by default: no host read, no error (the groups: test_op_quantize.py)
    K.topk_prune(x.view(3, 100), k=3)


@pytest.mark.parametrize("huge", [3e38, -3e38])
def test_finite_overflowing_range_is_not_called_nan(huge):
    """+-3e38 is finite, but max - min overflows fp32: the error must say so, not 'NaN or Inf'."""
    x = randn((256,))
    x[5] = huge
    x[6] = -huge
    with pytest.raises(ValueError, match="exceeds the largest float32") as info:
        K.quantize(x, 8, 128, check_finite=True)
    assert "NaN or Inf" not in str(info.value)
    K.quantize(x[128:], 8, 128, check_finite=True)  # the other group alone is fine


def test_quantize_argument_errors():
    x = randn((10,))
    with pytest.raises(ValueError, match="bits"):
        K.quantize(x, 3, 128)
    with pytest.raises(ValueError, match="group_size"):
        K.quantize(x, 8, 100)
    with pytest.raises(TypeError, match="dtype"):
        K.quantize(x.double(), 8, 128)
    with pytest.raises(TypeError, match="dtype"):
        K.quantize(torch.arange(10), 8, 128)
    with pytest.raises(ValueError, match="seed"):
        K.quantize(x, 8, 128, stochastic=True, seed=-1)


def test_topk_argument_errors():
    x = randn((2, 10))
    with pytest.raises(ValueError, match="k must be"):
        K.topk_prune(x, k=11)
    with pytest.raises(ValueError, match="k must be"):
        K.topk_prune(x, k=0)
    with pytest.raises(ValueError, match="ratio"):
        K.topk_prune(x, ratio=0.0)
    with pytest.raises(ValueError, match="exactly one"):
        K.topk_prune(x)
    assert K.topk_prune(x, ratio=0.1).values.shape == (2, 1)


def test_bits_and_dropout_argument_errors():
    with pytest.raises(TypeError, match="bool"):
        K.pack_bits(torch.ones(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="cannot hold"):
        K.unpack_bits(torch.zeros(2, dtype=torch.uint8), (17,))
    assert K.unpack_bits(torch.zeros(2, dtype=torch.uint8), (2, 8)).shape == (2, 8)
    with pytest.raises(ValueError, match="p must be"):
        K.seeded_dropout(torch.randn(3), 1.5, 0)
    with pytest.raises(ValueError, match="p must be"):
        K.dropout_mask(torch.randn(3), -0.5, 0)
    assert math.isclose(K.dropout_mask(torch.empty(1000), 0.0, 1).float().mean().item(), 1.0)
