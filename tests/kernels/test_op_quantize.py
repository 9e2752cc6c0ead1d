"""slimfit::quantize on every backend: bit for bit the reference (codes, scale, offset, for nearest and
stochastic rounding), and the properties the specification promises (round trip within half a step,
unbiased and reproducible stochastic rounding, exact constant groups, the packing layout, NaN/Inf)."""
import math

import pytest
import torch
from _backends import BITS, COMPARED, FLOATS, GROUP_SIZES, LAUNCHES, assert_same, check, non_contiguous, randn

from slimfit import kernels as K
from slimfit.kernels import reference

# awkward shapes: one element, 0-d, odd lengths, a short tail group, 3-d, empty, several blocks
SHAPES = [(), (1,), (7,), (3, 77), (2, 3, 5), (0, 5), (4, 256), (1000,), (5, 300)]
INTERPRETER_SHAPES = [(), (37,), (3, 100), (0, 5)]
SEEDS = [0, 123456789, 2**40 + 5]
INTERPRETER_GROUPS = (32, 256)


def quantize_both(backend, x, bits, group_size, stochastic, seed):
    """quantize vs the reference, then dequantize of its result vs the reference (to x's dtype where the
    backend writes it faithfully); returns the backend's (codes, scale, offset)."""
    got, _ = check(backend, "quantize", x, bits, group_size, stochastic, seed)
    check(backend, "dequantize", *got, bits, group_size, list(x.shape), backend.out_dtype(x.dtype))
    return got


@pytest.mark.backend_grid(reason=f"{COMPARED}; {LAUNCHES}", reference=False,
                          interpreter={"group_size": INTERPRETER_GROUPS, "dtype": (torch.float32, torch.float16)})
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("bits", BITS)
def test_matches_reference(backend, bits, group_size, dtype):
    for i, shape in enumerate(backend.choose(SHAPES, INTERPRETER_SHAPES)):
        x = randn(shape, dtype, seed=i, device=backend.device)
        quantize_both(backend, x, bits, group_size, False, 0)
        quantize_both(backend, x, bits, group_size, True, SEEDS[i % len(SEEDS)])
    for x in backend.choose(non_contiguous(dtype, backend.device), []):  # transposed, strided
        quantize_both(backend, x, bits, group_size, False, 0)
        quantize_both(backend, x, bits, group_size, True, 99)


@pytest.mark.backend_grid(reason=f"{COMPARED}; in the interpreter: test_triton_launchers.py, with smaller "
                          "programs; on the CPU one shape (the reference takes ~25 ms a call at this size on "
                          "a loaded 2-core machine)", reference=False, interpreter=False, native={"shape": ((8269,),)})
@pytest.mark.parametrize("shape", [(2 * 4096 + 77,), (33, 257)], ids=str)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_several_blocks(backend, group_size, dtype, shape):
    """More elements than one Triton program or CUDA block takes (4096), the last one partial."""
    x = randn(shape, dtype, seed=3, device=backend.device)
    quantize_both(backend, x, 4, group_size, True, 1234)


@pytest.mark.backend_grid(reason=f"{COMPARED}; {LAUNCHES}", reference=False,
                          interpreter={"dtype": (torch.float32, torch.bfloat16)})
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_views_match_contiguous_copy(backend, dtype):
    base = randn((64, 130), dtype, seed=11, device=backend.device)
    views = backend.choose(
        non_contiguous(dtype, backend.device) + [
            base.reshape(-1)[1:],          # storage offset: no 16-byte alignment
            base.reshape(-1)[3:4000],
            base[:1].expand(5, 130),
            base[:, ::3],
            randn((64, 48), dtype, device=backend.device).t()[:, 3:],
        ],
        [randn((40, 9), dtype, seed=4, device=backend.device).t()],
    )
    configs = backend.choose([(2, 32, False), (4, 128, True), (8, 256, False), (8, 64, True)],
                             [(2, 32, False), (8, 32, True)])
    for x in views:
        for bits, group_size, stochastic in configs:
            got, _ = check(backend, "quantize", x, bits, group_size, stochastic, 99)
            assert_same(got, backend.quantize(x.contiguous(), bits, group_size, stochastic, 99), "contiguous copy")


@pytest.mark.backend_grid(reason=LAUNCHES, interpreter={"dtype": (torch.bfloat16,)})
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_constant_and_zero_groups_are_exact(backend, bits, dtype):
    x = torch.cat([torch.full((64,), 3.25), torch.zeros(64), torch.full((5,), -7.5)]).to(dtype).to(backend.device)
    for stochastic in (False, True):
        codes, scale, offset = quantize_both(backend, x, bits, 32, stochastic, 1)
        y = backend.dequantize(codes, scale, offset, bits, 32, list(x.shape), dtype)
        assert torch.equal(y, x)


@pytest.mark.backend_grid(reason=f"{COMPARED}; {LAUNCHES}", reference=False, interpreter={"dtype": (torch.float32,)})
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_special_groups(backend, dtype):
    """Constant groups (scale 0 -> divisor 1), integer-valued data (exact .5 ties), +-0, tiny ranges."""
    x = torch.cat([
        torch.full((64,), 2.5), torch.zeros(64), torch.tensor([-0.0, 0.0] * 32),
        torch.arange(64.0) - 31.0, torch.arange(64.0) / 2, torch.tensor([1e-30, -1e-30] * 32),
    ]).to(dtype).to(backend.device)
    for bits in backend.choose(BITS, (2, 8)):
        for group_size in backend.choose(GROUP_SIZES, (32,)):
            for stochastic in (False, True):
                check(backend, "quantize", x, bits, group_size, stochastic, 5)


@pytest.mark.parametrize("bits", BITS)
def test_tiny_range_groups_are_constant(backend, bits):
    """A scale below the smallest normal fp32 (2**-126) is a constant group in every backend: its
    reciprocal would overflow and subnormal arithmetic differs between backends."""
    x = torch.randn(4 * 64, generator=torch.Generator().manual_seed(0))
    x[:64] = 1.0
    x[1:64:3] = 1.0 + 2.0**-23          # range 2**-23: a normal scale
    x[64:128] = 0.0
    x[65:128:5] = 2.0**-149             # range of one subnormal: a constant group
    x[128:192] = 1e-37
    x[129:192:7] = 2e-37                # range 1e-37: a constant group at 8 bits, not at 2 bits
    _, want = check(backend, "quantize", x.to(backend.device), bits, 64, False, 0)
    y = reference.dequantize(*want, bits, 64, (x.numel(),), torch.float32)
    assert torch.equal(y[64:128], torch.zeros(64))  # constant group: every code 0, back to mn
    assert (y[:192] - x[:192]).abs().max() <= 2.0**-23


def _wide_groups(dtype):
    """Groups whose range max - min exceeds the largest fp32 although every value is finite: +-3e38
    among ordinary values, values spread over the whole range with both extremes (reconstructions near
    them overshoot fp32 and saturate), a group with zeros and a subnormal too; then an ordinary group."""
    g = torch.Generator().manual_seed(5)
    top = torch.finfo(dtype).max
    a = torch.randn(64, generator=g) * 1e37
    a[[3, 40]] = torch.tensor([3e38, -3e38])
    b = (torch.rand(64, generator=g, dtype=torch.float64) * 2 - 1) * top
    b[[0, 1, 2]] = torch.tensor([top, -top, top * (1 - 2**-20)], dtype=torch.float64)
    c = torch.randn(64, generator=g)
    c[[7, 8, 9, 10]] = torch.tensor([2.5e38, -1e38, 1e-40, -0.0])
    return torch.cat([a.double(), b, c.double(), torch.randn(37, generator=g).double()]).to(dtype)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy overflow in the interpreter's code * scale
@pytest.mark.backend_grid(reason=LAUNCHES, interpreter={"dtype": (torch.float32,)})
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_wide_groups_stay_finite(backend, dtype):
    """Finite in, finite out: a group whose range max - min overflows fp32 (+-3e38) gets a finite scale
    (it is computed at half scale) and dequantizes to finite values within half a step of the input (a
    step with stochastic rounding), bit for bit the reference. Before, its scale was inf and every
    element of the group came back NaN."""
    x = _wide_groups(dtype).to(backend.device)
    for bits in backend.choose(BITS, (2, 8)):
        for stochastic in (False, True):
            codes, scale, offset = quantize_both(backend, x, bits, 64, stochastic, 3)
            assert torch.isfinite(scale).all() and torch.isfinite(offset).all(), scale
            y = backend.dequantize(codes, scale, offset, bits, 64, list(x.shape), torch.float32).cpu().double()
            assert torch.isfinite(y).all()
            xd = x.cpu().double()
            step = scale.cpu().double().repeat_interleave(64)[: x.numel()]
            # half a step (a step stochastic), plus fp32 rounding of the result
            bound = step * (1.0 if stochastic else 0.5) * (1 + 1e-5) + torch.maximum(xd.abs(), y.abs()) * 2**-23
            assert bool(((y - xd).abs() <= bound).all()), (bits, stochastic, float(((y - xd).abs() - bound).max()))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy overflow in the interpreter's code * scale
@pytest.mark.parametrize("bits", BITS)
def test_full_range_group_round_trips_its_extremes(backend, bits):
    """+-FLT_MAX in one group (range 2 * FLT_MAX): scale = 2 * FLT_MAX / (2**bits - 1) exactly (2**24 - 1
    is a multiple of 3, 15 and 255) and both extremes come back exactly, although code * scale of the
    top code is 2 * FLT_MAX: dequantize computes that value a quarter down."""
    top = torch.finfo(torch.float32).max
    levels = 2**bits - 1
    x = torch.tensor([top, -top] + [0.0] * 30, device=backend.device)
    (codes, scale, offset), _ = check(backend, "quantize", x, bits, 32, False, 0)
    assert scale.item() == 2 * top / levels and offset.item() == -top
    y, _ = check(backend, "dequantize", codes, scale, offset, bits, 32, [32], torch.float32)
    assert y[0].item() == top and y[1].item() == -top
    assert float(y[2:].abs().max()) <= scale.item() / 2


ROUND_TRIP_SHAPES = [(1,), (7,), (3, 77), (2, 3, 5), (4, 256), (1000,), (7, 300)]


@pytest.mark.backend_grid(reason="its bits are the reference's (test_matches_reference); the interpreter pays "
                          "per launch", interpreter=False)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("bits", BITS)
def test_nearest_round_trip_within_half_step(backend, bits, group_size, dtype):
    for i, shape in enumerate(ROUND_TRIP_SHAPES):
        x = randn(shape, dtype, seed=100 + i, device=backend.device)
        codes, scale, offset = backend.quantize(x, bits, group_size, False, 0)
        y = backend.dequantize(codes, scale, offset, bits, group_size, list(shape), dtype)
        assert y.dtype == dtype and y.shape == x.shape
        x, y, scale = x.float().cpu().reshape(-1), y.float().cpu().reshape(-1), scale.cpu()
        group = torch.arange(x.numel()) // group_size
        err = (y - x).abs()
        # half a step, plus the rounding of the output dtype (relative to the dequantized value,
        # which may exceed |x| by half a step) and of fp32 arithmetic
        out_eps = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
        bound = scale[group] / 2 * (1 + 1e-5) + torch.maximum(x.abs(), y.abs()) * out_eps + 1e-6
        assert bool((err <= bound).all()), (shape, float((err - bound).max()))


@pytest.mark.parametrize("bits", BITS)
def test_packed_sizes_and_layout(backend, bits):
    n = 37
    x = torch.linspace(-1, 1, n, device=backend.device)
    (codes, scale, offset), _ = check(backend, "quantize", x, bits, 32, False, 0)
    per = 8 // bits
    assert codes.dtype == torch.uint8 and codes.numel() == math.ceil(n / per)
    assert scale.numel() == offset.numel() == math.ceil(n / 32)
    codes = codes.cpu()
    unpacked = reference._unpack_codes(codes, bits, n)
    assert int(codes[0]) & ((1 << bits) - 1) == int(unpacked[0])   # element 0 in the lowest bits of byte 0
    used = n - (codes.numel() - 1) * per
    assert int(codes[-1]) >> (used * bits) == 0                     # unused high bits of the last byte are zero


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 128), (0, 5)], ids=str)
def test_empty(backend, shape, dtype):
    x = torch.empty(shape, dtype=dtype, device=backend.device)
    codes, scale, offset = quantize_both(backend, x, 4, 64, False, 0)
    assert codes.numel() == 0 and scale.numel() == 0 and offset.numel() == 0
    y = backend.dequantize(codes, scale, offset, 4, 64, list(shape), dtype)
    assert y.shape == shape and y.dtype == dtype and y.device == x.device


# ------------------------------------------------------------------ stochastic rounding
def test_seeds_reproducible_and_distinct(backend):
    x = randn(backend.choose((3, 333), (256,)), seed=2, device=backend.device)
    seeds = backend.choose([0, 1, 2**32 - 1, 2**32, 2**40 + 5, 2**63 - 1], [1, 2**63 - 1])
    codes = {}
    for seed in seeds:
        (codes[seed], _, _), _ = check(backend, "quantize", x, 4, 64, True, seed)
        assert torch.equal(codes[seed], backend.quantize(x, 4, 64, True, seed)[0])
    assert len({bytes(c.cpu().numpy()) for c in codes.values()}) == len(seeds)


def test_negative_seed_reads_as_unsigned(backend):
    """The op (not the wrapper, which refuses it) accepts any int64 seed and reads it as unsigned
    64-bit, as the reference does."""
    check(backend, "quantize", randn((4, 129), device=backend.device), 4, 64, True, -3)


@pytest.mark.backend_grid(reason="bit for bit the reference's stream (test_matches_reference); 400 launches "
                          "take 10 s in the interpreter", interpreter=False)
@pytest.mark.parametrize("bits", BITS)
def test_stochastic_rounding_is_unbiased(backend, bits):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).to(backend.device)
    seeds = 400
    acc = torch.zeros_like(x, dtype=torch.float64)
    for s in range(seeds):
        q = backend.quantize(x, bits, 64, True, s)
        acc += backend.dequantize(*q, bits, 64, list(x.shape), torch.float32).double()
    err = acc / seeds - x.double()
    step = backend.quantize(x, bits, 64, False, 0)[1].max().item()
    # per-element std of the mean <= step / (2 sqrt(seeds)); allow 5 sigma
    assert err.abs().max().item() < 5 * step / (2 * math.sqrt(seeds))
    # and the bias over all elements is a tiny fraction of a step
    assert abs(err.mean().item()) < 0.01 * step


@pytest.mark.backend_grid(reason="bit for bit the reference's stream (test_matches_reference); 200 launches "
                          "take 5 s in the interpreter, 5 s in the pure-PyTorch reference",
                          interpreter=False, reference=False)
def test_stochastic_rounding_bias_per_element(backend):
    x = randn((4096,), seed=4, device=backend.device)
    bits, group_size, seeds = 2, 128, 200
    acc = torch.zeros_like(x, dtype=torch.float64)
    for seed in range(seeds):
        c, s, o = backend.quantize(x, bits, group_size, True, seed)
        acc += backend.dequantize(c, s, o, bits, group_size, list(x.shape), torch.float32).double()
    step = s.repeat_interleave(group_size)[: x.numel()].double()
    bias = (acc / seeds - x.double()) / step
    # Per element, the mean of 200 draws has a standard error of at most 0.5 / sqrt(200)
    # ~ 0.035 steps (about 0.029 on average); the reference gives 0.0003 / 0.022 / 0.149
    # for these three statistics on exactly this input, and every backend is bit-exact with it.
    assert abs(float(bias.mean())) < 0.005
    assert float(bias.abs().mean()) < 0.035
    assert float(bias.abs().max()) < 0.25


# ---------------------------------------------------------------------------- NaN / Inf
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN/Inf arithmetic in the interpreter
@pytest.mark.backend_grid(reason=LAUNCHES, interpreter={"dtype": (torch.float32,)})
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_non_finite_groups(backend, dtype):
    """A group holding NaN/Inf gets a non-finite scale or offset (a NaN one: both NaN, like amin/amax);
    the other groups, and their codes, are the reference's."""
    group_size = 32
    x = randn((6 * group_size + 7,), seed=8)
    x[1 * group_size + 3] = float("nan")
    x[2 * group_size + 5] = float("inf")
    x[3 * group_size + 1] = -float("inf")
    x[4 * group_size + 2] = float("inf")
    x[4 * group_size + 9] = -float("inf")
    x[6 * group_size + 6] = float("nan")  # in the short tail group
    x = x.to(dtype).to(backend.device)
    for bits in backend.choose(BITS, (4,)):
        for stochastic in (False, True):
            codes, scale, offset = (t.cpu() for t in backend.quantize(x, bits, group_size, stochastic, 9))
            rc, rs, ro = reference.quantize(x.cpu(), bits, group_size, stochastic, 9)
            finite = torch.isfinite(rs) & torch.isfinite(ro)
            assert finite.tolist() == [True, False, False, False, False, True, False]
            assert torch.equal(torch.isfinite(scale) & torch.isfinite(offset), finite)
            assert scale[[1, 6]].isnan().all() and offset[[1, 6]].isnan().all()
            assert_same(scale[finite], rs[finite], "scale of finite groups")
            assert_same(offset[finite], ro[finite], "offset of finite groups")
            per_group = group_size * bits // 8
            for g in finite.nonzero().flatten().tolist():
                sl = slice(g * per_group, (g + 1) * per_group)
                assert_same(codes[sl], rc[sl], f"codes of group {g}")
            # check_finite off: a bad group stays visibly bad, every element of it non-finite
            y = backend.dequantize(*(t.to(backend.device) for t in (codes, scale, offset)), bits, group_size,
                                   list(x.shape), torch.float32).cpu()
            bad = ~finite.repeat_interleave(group_size)[: x.numel()]
            assert not torch.isfinite(y[bad]).any() and torch.isfinite(y[~bad]).all()
    if backend.dispatched:
        with pytest.raises(ValueError, match="NaN or Inf"):
            K.quantize(x, 8, group_size, check_finite=True)


# ------------------------------------------------------------------------------ errors
def test_invalid_arguments(backend):
    x = randn((100,), device=backend.device)
    with pytest.raises(backend.errors, match="bits"):
        backend.quantize(x, 3, 64, False, 0)
    with pytest.raises(backend.errors, match="group_size"):
        backend.quantize(x, 4, 48, False, 0)
    with pytest.raises(backend.errors, match="dtype"):
        backend.quantize(x.to(torch.int32), 4, 64, False, 0)
