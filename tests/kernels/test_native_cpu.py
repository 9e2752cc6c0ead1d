"""The C++ CPU kernels (csrc/cpu/) against the pure-PyTorch reference, bit for bit.

`torch.ops.slimfit.<op>` on CPU tensors dispatches to the native kernel once the
extension is loaded; `slimfit.kernels.reference.<op>` is the specification, called
directly. Every comparison is torch.equal (values, dtypes and shapes), including the
stochastic rounding and dropout streams, which depend only on (seed, flat index).
"""
from __future__ import annotations

import math

import pytest
import torch

from slimfit.kernels import backend_info
from slimfit.kernels import reference as ref

ops = torch.ops.slimfit

_INFO = backend_info()
pytestmark = pytest.mark.skipif(
    not _INFO["cpu"].startswith("native"),
    reason=f"the C++ CPU kernels are not loaded (SLIMFIT_BACKEND={_INFO['requested']}, "
    f"error: {_INFO['native_error'] or 'none'}); build them with `pip install --no-build-isolation -e .`",
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BITS = [2, 4, 8]
GROUP_SIZES = [32, 64, 128, 256]
# awkward shapes: one element, 0-d, odd lengths, a short tail group, 3-d, empty
SHAPES = [(1,), (), (3, 77), (2, 3, 5), (0, 5), (1000,), (5, 300)]
SEEDS = [0, 123456789, 2**40 + 5]


def _randn(shape, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _non_contiguous(dtype):
    """A transposed and a strided view (row-major order differs from memory order)."""
    base = _randn((77, 6), dtype, seed=7)
    return [base.t(), base[::2, 1:5], base.t()[:, ::3]]


def _assert_same(native, expected):
    if isinstance(expected, (tuple, list)):
        assert len(native) == len(expected)
        for a, b in zip(native, expected):
            _assert_same(a, b)
        return
    assert native.dtype == expected.dtype, (native.dtype, expected.dtype)
    assert native.shape == expected.shape, (native.shape, expected.shape)
    assert torch.equal(native, expected)


def test_cpu_kernels_are_native():
    for name in ("quantize", "dequantize", "topk_prune", "topk_restore", "pack_bits", "unpack_bits",
                 "dropout_mask", "seeded_dropout"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"slimfit::{name}", "CPU"), name


# ---------------------------------------------------------------- quantize / dequantize
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("bits", BITS)
def test_quantize_nearest_and_stochastic(bits, group_size, dtype):
    for i, shape in enumerate(SHAPES):
        x = _randn(shape, dtype, seed=i)
        _assert_same(ops.quantize(x, bits, group_size, False, 0), ref.quantize(x, bits, group_size, False, 0))
        seed = SEEDS[i % len(SEEDS)]
        _assert_same(ops.quantize(x, bits, group_size, True, seed), ref.quantize(x, bits, group_size, True, seed))
    for x in _non_contiguous(dtype):
        for stochastic in (False, True):
            _assert_same(ops.quantize(x, bits, group_size, stochastic, 99),
                         ref.quantize(x, bits, group_size, stochastic, 99))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_special_groups(dtype):
    """Constant groups (scale 0 -> divisor 1), integer-valued data (exact .5 ties), +-0."""
    x = torch.cat([
        torch.full((64,), 2.5), torch.zeros(64), torch.tensor([-0.0, 0.0] * 32),
        torch.arange(64.0) - 31.0, torch.arange(64.0) / 2, torch.tensor([1e-30, -1e-30] * 32),
    ]).to(dtype)
    for bits in BITS:
        for gs in GROUP_SIZES:
            for stochastic in (False, True):
                _assert_same(ops.quantize(x, bits, gs, stochastic, 5), ref.quantize(x, bits, gs, stochastic, 5))


def test_quantize_seeds_change_stream_and_negative_seed_wraps():
    x = _randn((4, 129), torch.float32)
    a = ops.quantize(x, 2, 32, True, 1)[0]
    b = ops.quantize(x, 2, 32, True, 2)[0]
    assert not torch.equal(a, b)
    # The op itself accepts any int64 seed and reads it as unsigned 64-bit, as the reference does.
    _assert_same(ops.quantize(x, 4, 64, True, -3), ref.quantize(x, 4, 64, True, -3))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_non_finite_group_has_non_finite_scale_or_offset(dtype, bad):
    x = _randn((300,), dtype)
    x[70] = bad  # second group of 64
    for bits in BITS:
        codes, scale, offset = ops.quantize(x, bits, 64, False, 0)
        r_codes, r_scale, r_offset = ref.quantize(x, bits, 64, False, 0)
        assert not (math.isfinite(scale[1].item()) and math.isfinite(offset[1].item()))
        finite = torch.ones(scale.numel(), dtype=torch.bool)
        finite[1] = False
        assert torch.equal(scale[finite], r_scale[finite]) and torch.equal(offset[finite], r_offset[finite])
        # codes of the untouched groups agree (bytes outside group 1)
        per = 8 // bits
        keep = torch.ones(codes.numel(), dtype=torch.bool)
        keep[64 // per: 128 // per] = False
        assert torch.equal(codes[keep], r_codes[keep])
    if bad != bad:  # a NaN group gives NaN min and max, like amin/amax
        _, scale, offset = ops.quantize(x, 8, 64, True, 3)
        assert math.isnan(scale[1].item()) and math.isnan(offset[1].item())


@pytest.mark.parametrize("out_dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("bits", BITS)
def test_dequantize(bits, group_size, out_dtype):
    for i, shape in enumerate(SHAPES):
        x = _randn(shape, torch.float32, seed=10 + i)
        codes, scale, offset = ref.quantize(x, bits, group_size, True, 17)
        _assert_same(ops.dequantize(codes, scale, offset, bits, group_size, list(shape), out_dtype),
                     ref.dequantize(codes, scale, offset, bits, group_size, list(shape), out_dtype))
    # arbitrary (non-quantizer) codes and scales; non-contiguous scale/offset
    g = torch.Generator().manual_seed(1)
    n = 1000
    ng = (n + group_size - 1) // group_size
    codes = torch.randint(0, 256, ((n * bits + 7) // 8,), dtype=torch.uint8, generator=g)
    scale = torch.rand(2 * ng, generator=g)[::2] * 1e-3
    offset = torch.randn(ng, 2, generator=g)[:, 1]
    _assert_same(ops.dequantize(codes, scale, offset, bits, group_size, [10, 100], out_dtype),
                 ref.dequantize(codes, scale, offset, bits, group_size, [10, 100], out_dtype))


def test_quantize_dequantize_round_trip_within_half_step():
    x = _randn((7, 300), torch.float32)
    for bits in BITS:
        codes, scale, offset = ops.quantize(x, bits, 128, False, 0)
        y = ops.dequantize(codes, scale, offset, bits, 128, list(x.shape), torch.float32)
        flat_scale = scale.repeat_interleave(128)[: x.numel()].view_as(x)
        assert bool(((y - x).abs() <= flat_scale * 0.5 * (1 + 1e-5) + 1e-6).all())


# ---------------------------------------------------------------- top-k
def _topk_inputs(dtype):
    g = torch.Generator().manual_seed(3)
    return [
        torch.randn(4, 77, generator=g).to(dtype),
        torch.randint(-3, 4, (5, 64), generator=g).to(dtype),  # many ties
        torch.randint(-1, 2, (2, 3, 33), generator=g).to(dtype),  # 3-d, ties
        torch.randn(1, generator=g).to(dtype),  # one element
        torch.tensor([0.0, -0.0, 0.0, -0.0, 1.0, -1.0], dtype=dtype),  # +-0 tie
        torch.randn(9, 8, generator=g).to(dtype).t(),  # non-contiguous
        torch.randn(6, 40, generator=g).to(dtype)[:, 3:35],  # sliced rows
    ]


@pytest.mark.parametrize("by_magnitude", [False, True], ids=["by_value", "by_magnitude"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_topk_prune_and_restore(dtype, by_magnitude):
    for x in _topk_inputs(dtype):
        row = x.shape[-1]
        for k in sorted({min(k, row) for k in (1, 2, max(1, row // 10), row // 2 or 1, row - 1 or 1, row)}):
            got = ops.topk_prune(x, k, by_magnitude)
            expected = ref.topk_prune(x, k, by_magnitude)
            _assert_same(got, expected)
            _assert_same(ops.topk_restore(got[0], got[1], row), ref.topk_restore(*expected, row))


def test_topk_restore_row_length_zero():
    """k >= 1 kept entries cannot sit in rows of length 0: an error naming the problem (the native
    kernel used to return an empty tensor), as the reference's scatter refuses it; no entries in
    rows of length 0 is a valid empty result."""
    v, i = torch.randn(3, 2), torch.zeros(3, 2, dtype=torch.int16)
    with pytest.raises(RuntimeError, match="row_length is 0"):
        ops.topk_restore(v, i, 0)
    with pytest.raises(RuntimeError):
        ref.topk_restore(v, i, 0)
    e, ei = torch.randn(3, 0), torch.zeros(3, 0, dtype=torch.int16)
    _assert_same(ops.topk_restore(e, ei, 0), ref.topk_restore(e, ei, 0))


@pytest.mark.parametrize("bits", BITS)
def test_quantize_tiny_range_groups_are_constant(bits):
    """A scale below the smallest normal fp32 (2**-126) is a constant group in every backend: its
    reciprocal would overflow and subnormal arithmetic differs between backends."""
    x = torch.randn(4 * 64)
    x[:64] = 1.0
    x[1:64:3] = 1.0 + 2.0**-23          # range 2**-23: a normal scale
    x[64:128] = 0.0
    x[65:128:5] = 2.0**-149             # range of one subnormal: a constant group
    x[128:192] = 1e-37
    x[129:192:7] = 2e-37                # range 1e-37: a constant group at 8 bits, not at 2 bits
    got, want = ops.quantize(x, bits, 64, False, 0), ref.quantize(x, bits, 64, False, 0)
    _assert_same(got, want)
    y = ref.dequantize(*want, bits, 64, (x.numel(),), torch.float32)
    assert torch.equal(y[64:128], torch.zeros(64))  # constant group: every code 0, back to mn
    assert (y[:192] - x[:192]).abs().max() <= 2.0**-23


def test_topk_empty_rows():
    x = torch.randn(0, 10)
    _assert_same(ops.topk_prune(x, 3, True), ref.topk_prune(x, 3, True))
    v, i = ops.topk_prune(x, 3, True)
    _assert_same(ops.topk_restore(v, i, 10), ref.topk_restore(v, i, 10))


def test_topk_non_finite_order_matches_reference():
    """Direct op calls (the Python wrapper rejects them) still follow torch's sort order:
    NaN of either sign ranks above +Inf; equal keys keep the lowest index."""
    nan = float("nan")
    x = torch.tensor([[1.0, nan, float("inf"), -nan, -float("inf"), 2.0, nan, 0.5]])
    for by_magnitude in (False, True):
        for k in range(1, 9):
            v, i = ops.topk_prune(x, k, by_magnitude)
            rv, ri = ref.topk_prune(x, k, by_magnitude)
            assert torch.equal(i, ri)
            assert torch.equal(v.isnan(), rv.isnan()) and torch.equal(v[~v.isnan()], rv[~rv.isnan()])


@pytest.mark.parametrize("by_magnitude", [False, True], ids=["by_value", "by_magnitude"])
def test_topk_long_rows_use_int32_indices(by_magnitude):
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-50, 50, (2, 40000), generator=g).to(torch.float32)  # ties at the threshold
    for k in (1, 4000, 40000):
        got = ops.topk_prune(x, k, by_magnitude)
        assert got[1].dtype == torch.int32
        _assert_same(got, ref.topk_prune(x, k, by_magnitude))
        _assert_same(ops.topk_restore(*got, 40000), ref.topk_restore(*got, 40000))
    # 32768 is the longest row with int16 indices
    x = torch.randn(1, 32768, generator=g)
    got = ops.topk_prune(x, 100, by_magnitude)
    assert got[1].dtype == torch.int16
    _assert_same(got, ref.topk_prune(x, 100, by_magnitude))
    _assert_same(ops.topk_restore(*got, 32768), ref.topk_restore(*got, 32768))


def test_topk_restore_int64_indices_and_other_dtypes():
    g = torch.Generator().manual_seed(8)
    values = torch.randn(3, 4, generator=g, dtype=torch.float64)
    indices = torch.stack([torch.randperm(10, generator=g)[:4].sort().values for _ in range(3)])
    _assert_same(ops.topk_restore(values, indices, 10), ref.topk_restore(values, indices, 10))
    _assert_same(ops.topk_restore(values.half(), indices.short(), 10), ref.topk_restore(values.half(), indices.short(), 10))


# ---------------------------------------------------------------- bits
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 64, 1003, 100_000])
def test_pack_unpack_bits(n):
    g = torch.Generator().manual_seed(n)
    mask = torch.rand(n, generator=g) > 0.5
    packed = ops.pack_bits(mask)
    _assert_same(packed, ref.pack_bits(mask))
    _assert_same(ops.unpack_bits(packed, n), ref.unpack_bits(packed, n))
    # unused high bits of the last byte are zero
    if n % 8:
        assert int(packed[-1]) >> (n % 8) == 0
    # random bytes, shorter numel than the bytes hold
    raw = torch.randint(0, 256, ((n + 7) // 8 + 1,), dtype=torch.uint8, generator=g)
    _assert_same(ops.unpack_bits(raw, n), ref.unpack_bits(raw, n))


def test_pack_bits_shapes_and_non_contiguous():
    g = torch.Generator().manual_seed(4)
    for mask in [torch.rand(3, 77, generator=g) > 0.3, (torch.rand(20, 13, generator=g) > 0.5).t(),
                 (torch.rand(9, 40, generator=g) > 0.5)[:, 1:38:3], torch.tensor(True), torch.ones(2, 0, dtype=torch.bool)]:
        _assert_same(ops.pack_bits(mask), ref.pack_bits(mask))
        _assert_same(ops.unpack_bits(ops.pack_bits(mask), mask.numel()).view(mask.shape), mask.contiguous())


# ---------------------------------------------------------------- dropout
P_VALUES = [0.0, 0.1, 0.5, 0.5 + 1e-12, 0.9, 1.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_mask_and_seeded_dropout(dtype):
    for i, shape in enumerate([(1,), (), (3, 77), (2, 3, 5), (0, 5), (1000,)]):
        x = _randn(shape, dtype, seed=20 + i)
        for p in P_VALUES:
            for seed in SEEDS:
                _assert_same(ops.dropout_mask(x, p, seed), ref.dropout_mask(x, p, seed))
                _assert_same(ops.seeded_dropout(x, p, seed), ref.seeded_dropout(x, p, seed))
    for x in _non_contiguous(dtype):
        _assert_same(ops.dropout_mask(x, 0.3, 11), ref.dropout_mask(x, 0.3, 11))
        _assert_same(ops.seeded_dropout(x, 0.3, 11), ref.seeded_dropout(x, 0.3, 11))


def test_dropout_mask_of_any_dtype_and_keep_rate():
    like = torch.empty(50_000, dtype=torch.int32)
    _assert_same(ops.dropout_mask(like, 0.25, 9), ref.dropout_mask(like, 0.25, 9))
    rate = ops.dropout_mask(like, 0.25, 9).float().mean().item()
    assert abs(rate - 0.75) < 0.01


# ---------------------------------------------------------------- argument checks
def test_invalid_arguments_raise():
    x = torch.randn(100)
    with pytest.raises(RuntimeError, match="bits"):
        ops.quantize(x, 3, 64, False, 0)
    with pytest.raises(RuntimeError, match="group_size"):
        ops.quantize(x, 4, 48, False, 0)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.quantize(x.to(torch.int32), 4, 64, False, 0)
    codes, scale, offset = ops.quantize(x, 4, 64, False, 0)
    with pytest.raises(RuntimeError, match="code bytes"):
        ops.dequantize(codes[:10], scale, offset, 4, 64, [100], torch.float32)
    with pytest.raises(RuntimeError, match="groups"):
        ops.dequantize(codes, scale[:1], offset, 4, 64, [100], torch.float32)
    with pytest.raises(RuntimeError, match="float32"):
        ops.dequantize(codes, scale.double(), offset, 4, 64, [100], torch.float32)
    with pytest.raises(RuntimeError, match="k must be"):
        ops.topk_prune(x.view(4, 25), 26, True)
    with pytest.raises(RuntimeError, match="k must be"):
        ops.topk_prune(x.view(4, 25), -1, True)
    with pytest.raises(RuntimeError, match="dimension"):
        ops.topk_prune(torch.tensor(1.0), 1, True)
    v, i = ops.topk_prune(x.view(4, 25), 5, True)
    with pytest.raises(RuntimeError, match="outside"):
        ops.topk_restore(v, i, 10)
    with pytest.raises(RuntimeError, match="outside"):
        ops.topk_restore(v, -i - 1, 25)
    with pytest.raises(RuntimeError, match="same shape"):
        ops.topk_restore(v, i[:, :2], 25)
    with pytest.raises(RuntimeError, match="bool"):
        ops.pack_bits(torch.ones(8, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="cannot hold"):
        ops.unpack_bits(torch.zeros(2, dtype=torch.uint8), 17)
    with pytest.raises(RuntimeError, match="p must be"):
        ops.dropout_mask(x, 1.5, 0)
    with pytest.raises(RuntimeError, match="p must be"):
        ops.seeded_dropout(x, -0.1, 0)


# ---------------------------------------------------------------- opcheck
def _opcheck_cases():
    x = _randn((3, 77), torch.float32)
    xh = _randn((2, 40), torch.bfloat16)
    codes, scale, offset = ref.quantize(x, 4, 64, False, 0)
    v, i = ref.topk_prune(x, 8, True)
    mask = torch.rand(3, 77) > 0.5
    return [
        ("quantize", (x, 4, 64, True, 7)),
        ("quantize", (xh, 2, 32, False, 0)),
        ("dequantize", (codes, scale, offset, 4, 64, [3, 77], torch.float16)),
        ("topk_prune", (x, 8, True)),
        ("topk_restore", (v, i, 77)),
        ("pack_bits", (mask,)),
        ("unpack_bits", (ref.pack_bits(mask), 231)),
        ("dropout_mask", (x, 0.2, 3)),
        ("seeded_dropout", (xh, 0.2, 3)),
    ]


_OPCHECK_CASES = _opcheck_cases()


@pytest.mark.parametrize("name,args", _OPCHECK_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(_OPCHECK_CASES)])
def test_opcheck(name, args):
    torch.library.opcheck(getattr(ops, name).default, args)
