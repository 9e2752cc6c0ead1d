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
def test_finite_wide_range_quantizes(huge):
    """+-3e38 is finite, though max - min overflows fp32: check_finite=True has nothing to report, and the
    group round-trips within half a step (it used to get an inf scale and come back all NaN)."""
    x = randn((256,))
    x[5] = huge
    x[6] = -huge
    q = K.quantize(x, 8, 128, check_finite=True)
    y = K.dequantize(q).double()
    assert torch.isfinite(y).all()
    step = q.scale.double().repeat_interleave(128)
    assert bool(((y - x.double()).abs() <= step / 2 * (1 + 1e-5) + y.abs() * 2**-23).all())


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


def test_flags_must_be_bools():
    """stochastic / by_magnitude / storage_order: a string or None is refused, not read by bool()
    ("False" is truthy); True/False, numpy bools and 0/1 are fine."""
    np = pytest.importorskip("numpy")
    x = randn((64,))
    for bad in ("False", None, 0.5, torch.tensor([True, False])):
        with pytest.raises(TypeError, match="stochastic must be True or False"):
            K.quantize(x, 8, 32, stochastic=bad, seed=1)
        with pytest.raises(TypeError, match="by_magnitude must be True or False"):
            K.topk_prune(x.view(4, 16), k=2, by_magnitude=bad)
        with pytest.raises(TypeError, match="storage_order must be True or False"):
            K.quantize(x, 8, 32, storage_order=bad)
    want = K.quantize(x, 8, 32, stochastic=True, seed=1).codes
    for good in (True, np.True_, 1):
        assert torch.equal(K.quantize(x, 8, 32, stochastic=good, seed=1).codes, want)


def test_integer_arguments_of_other_types():
    """numpy and 0-d tensor ints are ints: the QuantizedTensor holds plain ints (its metadata is hashed
    and saved), the same codes as with Python ints; a bool tensor seed is a bool, refused; numpy float p."""
    np = pytest.importorskip("numpy")
    x = randn((3, 77))
    want = K.quantize(x, 4, 64, stochastic=True, seed=5)
    for bits, group_size, seed in [(np.int64(4), np.int32(64), np.int64(5)), (torch.tensor(4), 64, torch.tensor(5))]:
        q = K.quantize(x, bits, group_size, stochastic=True, seed=seed)
        assert type(q.bits) is int and type(q.group_size) is int
        assert torch.equal(q.codes, want.codes)
    with pytest.raises(TypeError, match="seed must be an int"):
        K.quantize(x, 8, 128, stochastic=True, seed=torch.tensor(True))
    assert torch.equal(K.seeded_dropout(x, np.float32(0.5), 3), K.seeded_dropout(x, 0.5, 3))
    with pytest.raises(TypeError, match="ratio must be a float"):
        K.topk_prune(x, ratio="0.3")


def test_unpack_bits_shape_matches_the_packed_mask():
    """unpack_bits(packed, shape): shape is the packed mask's; a shape with fewer elements (it read a
    prefix) or a negative dimension is an error, an int is a 1-d shape."""
    mask = torch.rand(3, 7, generator=gen(2)) > 0.5
    packed = K.pack_bits(mask)
    assert torch.equal(K.unpack_bits(packed, (3, 7)), mask)
    assert torch.equal(K.unpack_bits(packed, 21), mask.view(-1))
    with pytest.raises(ValueError, match="are more than the 3 bits"):
        K.unpack_bits(packed, (3,))
    with pytest.raises(ValueError, match="negative dimension"):
        K.unpack_bits(packed, (-1, 21))
    with pytest.raises(TypeError, match="shape must be"):
        K.unpack_bits(packed, (3.0, 7))


def test_wrappers_refuse_what_is_not_theirs():
    """Containers and dtypes of the wrong type: a TypeError naming the argument, not an AttributeError."""
    x = randn((4, 16))
    with pytest.raises(TypeError, match="expected the QuantizedTensor"):
        K.dequantize(tuple(K.quantize(x, 8, 32)))
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        K.dequantize(K.quantize(x, 8, 32), "float32")
    with pytest.raises(TypeError, match="expected the PrunedTensor"):
        K.topk_restore(tuple(K.topk_prune(x, k=2)))
    with pytest.raises(TypeError, match="mask must be a torch.Tensor"):
        K.pack_bits([True, False])
    with pytest.raises(TypeError, match="packed must be a torch.Tensor"):
        K.unpack_bits([1, 2], (16,))
    with pytest.raises(TypeError, match="like must be a torch.Tensor"):
        K.dropout_mask([1.0, 2.0], 0.5, 1)
