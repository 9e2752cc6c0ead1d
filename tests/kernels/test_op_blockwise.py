"""slimfit::quantize_blockwise / dequantize_blockwise on every backend: bit for bit the reference (codes,
block maxima and restored values), and what the specification promises: the nearest level (a value within
half the local gap of the map times its block's absmax), ties to the lower level, the block's largest
element and zeros exact, a second moment never restored as 0 by the zero-free map, the 4-bit packing,
NaN/Inf blocks visibly non-finite, and the argument checks."""
import pytest
import torch
from _backends import COMPARED, FLOATS, LAUNCHES, assert_same, check, non_contiguous, randn

from slimfit import kernels as K
from slimfit.kernels import qmaps, reference

BLOCK_SIZES = [32, 64, 256, 4096]
MAPS = [("signed", 8), ("signed", 4), ("unsigned", 8), ("unsigned", 4)]
MAP_IDS = [f"{kind}{bits}" for kind, bits in MAPS]
# awkward shapes: 0-d, one element, odd lengths (a half-filled last byte at 4 bits), a short last block,
# 3-d, several Triton programs (4096 elements each)
SHAPES = [(), (1,), (7,), (3, 77), (2, 3, 5), (4, 256), (1000,), (5, 300), (2 * 4096 + 77,)]
INTERPRETER_SHAPES = [(), (37,), (3, 100), (2 * 1024 + 33,)]
INTERPRETER_BLOCKS = (32, 4096)


def moment_like(shape, kind, dtype=torch.float32, seed=0, device="cpu"):
    """Values spread over decades within a block (as optimizer moments are); non-negative for an unsigned
    map, with exact zeros in both."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    x = torch.randn(n, generator=g) * torch.exp(torch.empty(n).uniform_(-18, 2, generator=g))
    x[::11] = 0.0
    if kind != "signed":
        x = x.abs()
    return x.view(shape).to(dtype).to(device)


def qmap(kind, bits, device="cpu"):
    return qmaps.MAPS[kind](bits).to(device)


def both(backend, x, q, block_size, dtype=None):
    """quantize_blockwise vs the reference, then dequantize_blockwise of its result vs the reference."""
    got, _ = check(backend, "quantize_blockwise", x, q, block_size, bitwise=True)
    out = backend.out_dtype(dtype or x.dtype)
    y, _ = check(backend, "dequantize_blockwise", *got, q, block_size, list(x.shape), out, bitwise=True)
    return got, y


@pytest.mark.backend_grid(reason=f"{COMPARED}; {LAUNCHES}", reference=False,
                          interpreter={"block_size": INTERPRETER_BLOCKS, "dtype": (torch.float32, torch.bfloat16)})
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("kind,bits", MAPS, ids=MAP_IDS)
def test_matches_reference(backend, kind, bits, block_size, dtype):
    q = qmap(kind, bits, backend.device)
    for i, shape in enumerate(backend.choose(SHAPES, INTERPRETER_SHAPES)):
        both(backend, moment_like(shape, kind, dtype, seed=i, device=backend.device), q, block_size)
    if kind == "signed":   # transposed and strided views: flattened in their logical order
        for x in backend.choose(non_contiguous(dtype, backend.device), []):
            got, _ = both(backend, x, q, block_size)
            assert_same(got, backend.quantize_blockwise(x.contiguous(), q, block_size), "contiguous copy")


@pytest.mark.backend_grid(reason=LAUNCHES, interpreter={"bits": (4,)})
@pytest.mark.parametrize("bits", [8, 4])
def test_ties_go_to_the_lower_level(backend, bits):
    """y exactly on a midpoint (a block whose absmax is 1: y = x) takes the lower level, on every backend;
    just above it, the upper one."""
    q = qmaps.signed(bits)
    mid = (q[:-1] + q[1:]) * 0.5
    above = torch.nextafter(mid, torch.full_like(mid, 2.0))
    x = torch.cat([torch.ones(1), mid, above]).to(backend.device)
    (codes, _), _ = both(backend, x, q.to(backend.device), 4096)
    codes = reference._unpack_codes(codes.cpu(), bits, x.numel())
    levels = torch.arange(mid.numel())
    assert torch.equal(codes[1:1 + mid.numel()], levels)
    assert torch.equal(codes[1 + mid.numel():], levels + 1)


def _local_bound(x, y, absmax, levels, block_size, out_dtype):
    """Per element, half the gap of the two levels around x / absmax (the distance to the smallest level
    below it), times absmax; plus fp32 rounding of y = x * (1 / absmax) and the output dtype's rounding."""
    a = absmax.double().repeat_interleave(block_size)[: x.numel()]
    lv = levels.double()
    t = torch.where(a > 0, x.double() / torch.where(a > 0, a, 1.0), 0.0)
    i = torch.searchsorted(lv, t).clamp(1, lv.numel() - 1)
    half_gap = (lv[i] - lv[i - 1]) / 2
    below = (lv[0] - t).clamp_min(0)
    eps = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[out_dtype]
    return torch.maximum(half_gap, below) * a + a * 2**-21 + y.double().abs() * eps


@pytest.mark.backend_grid(reason="its bits are the reference's (test_matches_reference); the interpreter pays "
                          "per launch", interpreter=False)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("kind,bits", MAPS, ids=MAP_IDS)
def test_round_trip_within_half_the_local_gap(backend, kind, bits, block_size, dtype):
    q = qmap(kind, bits)
    for i, shape in enumerate([(1,), (7,), (3, 77), (1000,), (5, 300)]):
        x = moment_like(shape, kind, dtype, seed=50 + i, device=backend.device)
        codes, absmax = backend.quantize_blockwise(x, q.to(backend.device), block_size)
        y = backend.dequantize_blockwise(codes, absmax, q.to(backend.device), block_size, list(shape), dtype)
        assert y.dtype == dtype and y.shape == x.shape
        x, y, absmax = x.float().cpu().reshape(-1), y.float().cpu().reshape(-1), absmax.cpu()
        bound = _local_bound(x, y, absmax, q, block_size, dtype)
        err = (y.double() - x.double()).abs()
        assert bool((err <= bound).all()), (shape, float((err - bound).max()))


@pytest.mark.parametrize("bits", [8, 4])
def test_largest_element_and_zeros_are_exact(backend, bits):
    """1.0 and 0 are levels of the signed map: each block's largest element (either sign) and every 0 come
    back exactly; a block of zeros has absmax 0 and comes back as zeros with either map."""
    x = randn((3 * 64,), seed=4, device="cpu")
    x[5], x[64 + 9], x[::7] = 50.0, -60.0, 0.0
    x[128:] = 0.0
    for kind in ("signed", "unsigned"):
        xs = (x if kind == "signed" else x.abs()).to(backend.device)
        q = qmap(kind, bits, backend.device)
        (codes, absmax), y = both(backend, xs, q, 64)
        y, xs = y.cpu(), xs.cpu()
        assert absmax.cpu()[2] == 0 and torch.equal(y[128:], torch.zeros(64))
        assert y[5] == xs[5] and y[64 + 9] == xs[64 + 9]
        if kind == "signed":
            assert torch.equal(y[::7], torch.zeros_like(y[::7]))


@pytest.mark.backend_grid(reason=LAUNCHES, interpreter={"bits": (4,)})
@pytest.mark.parametrize("bits", [8, 4])
def test_the_unsigned_map_never_restores_a_positive_value_as_zero(backend, bits):
    """A second moment spread over 60 decades (1e-45 .. 1e15 at random, blocks with zeros, a block of
    zeros): every v > 0 whose block's restored smallest level does not underflow fp32 comes back > 0, and
    at least the smallest level times absmax; zeros of the map's y = 0 come back as that level or 0."""
    g = torch.Generator().manual_seed(3)
    v = torch.exp(torch.empty(4 * 256, dtype=torch.float64).uniform_(-103, 34, generator=g)).float()
    v[::13] = 0.0
    v[256:512] = 0.0
    q = qmaps.unsigned(bits)
    (_, absmax), y = both(backend, v.to(backend.device), q.to(backend.device), 256)
    y, absmax = y.cpu(), absmax.cpu().repeat_interleave(256)
    floor = q[0] * absmax
    positive = (v > 0) & (floor > 0)
    assert positive.sum() > 500
    assert bool((y[positive] >= floor[positive]).all()) and bool((y[positive] > 0).all())
    assert torch.equal(y[256:512], torch.zeros(256))


def test_subnormal_blocks_code_zero(backend):
    """A block whose absmax is below 2**-126 codes every y as 0 (its reciprocal would overflow, and a GPU
    may flush subnormals): restored as 0 with the signed map, within absmax of the input either way."""
    x = torch.zeros(3 * 32)
    x[:32] = 1e-39
    x[3] = -2e-39
    x[32:64:3] = 2.0**-149
    x[64:] = 1e-37   # a normal absmax: coded as usual
    for kind in ("signed", "unsigned"):
        xs = x if kind == "signed" else x.abs()
        (_, absmax), y = both(backend, xs.to(backend.device), qmap(kind, 8, backend.device), 32)
        y = y.cpu()
        if kind == "signed":
            assert torch.equal(y[:64], torch.zeros(64))
        assert bool(((y[:64] - xs[:64]).abs() <= absmax.cpu()[:2].repeat_interleave(32)).all())


@pytest.mark.parametrize("bits", [8, 4])
def test_packed_layout_and_sizes(backend, bits):
    n = 37
    x = torch.linspace(-1, 1, n, device=backend.device)
    (codes, absmax), _ = both(backend, x, qmap("signed", bits, backend.device), 32)
    assert codes.dtype == torch.uint8 and codes.numel() == -(-n * bits // 8)
    assert absmax.dtype == torch.float32 and absmax.numel() == 2
    codes = codes.cpu()
    if bits == 4:
        assert int(codes[0]) & 0xF == 0 and int(codes[-1]) >> 4 == 0   # x[0] = -1: level 0, low nibble first


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("shape", [(0,), (3, 0)], ids=str)
def test_empty(backend, shape, dtype):
    x = torch.empty(shape, dtype=dtype, device=backend.device)
    (codes, absmax), y = both(backend, x, qmap("signed", 4, backend.device), 64)
    assert codes.numel() == 0 and absmax.numel() == 0 and y.shape == shape


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN/Inf arithmetic in the interpreter
@pytest.mark.parametrize("kind", ["signed", "unsigned"])
def test_non_finite_blocks(backend, kind):
    """A block holding NaN or Inf gets a non-finite absmax and restores to non-finite values only; the
    other blocks are the reference's; the wrapper refuses it with check_finite=True."""
    x = moment_like((5 * 32 + 7,), kind, seed=8)
    x[32 + 3], x[2 * 32 + 5], x[3 * 32 + 1], x[5 * 32 + 2] = float("nan"), float("inf"), -float("inf"), float("nan")
    x = x.to(backend.device)
    q = qmap(kind, 8, backend.device)
    codes, absmax = backend.quantize_blockwise(x, q, 32)
    want_codes, want_absmax = reference.quantize_blockwise(x.cpu(), q.cpu(), 32)
    bad = ~torch.isfinite(absmax.cpu())
    assert bad.tolist() == [False, True, True, True, False, True]
    assert torch.equal(bad, ~torch.isfinite(want_absmax))
    assert_same(absmax.cpu()[~bad], want_absmax[~bad], "absmax of finite blocks", bitwise=True)
    for b in (~bad).nonzero().flatten().tolist():   # (which NaN a device makes is its own business)
        assert_same(codes.cpu()[32 * b: 32 * (b + 1)], want_codes[32 * b: 32 * (b + 1)], f"codes of block {b}")
    y = backend.dequantize_blockwise(codes, absmax, q, 32, [x.numel()], torch.float32).cpu()
    rows = bad.repeat_interleave(32)[: x.numel()]
    assert not torch.isfinite(y[rows]).any() and torch.isfinite(y[~rows]).all()
    if backend.dispatched:
        with pytest.raises(ValueError, match="NaN or Inf"):
            K.quantize_blockwise(x, q, 32, check_finite=True)
        K.quantize_blockwise(torch.nan_to_num(x, posinf=1.0, neginf=-1.0, nan=0.0), q, 32, check_finite=True)


def test_invalid_arguments(backend):
    x = randn((100,), device=backend.device)
    q = qmap("signed", 8, backend.device)
    with pytest.raises(backend.errors, match="block_size"):
        backend.quantize_blockwise(x, q, 48)
    with pytest.raises(backend.errors, match="qmap"):
        backend.quantize_blockwise(x, q[:100], 64)
    with pytest.raises(backend.errors, match="qmap"):
        backend.quantize_blockwise(x, q.double(), 64)
    with pytest.raises(backend.errors, match="strictly increasing"):
        backend.quantize_blockwise(x, q.flip(0).contiguous(), 64)
    with pytest.raises(backend.errors, match="dtype"):
        backend.quantize_blockwise(x.to(torch.int32), q, 64)
    codes, absmax = backend.quantize_blockwise(x, q, 64)
    with pytest.raises(backend.errors, match="code bytes"):
        backend.dequantize_blockwise(codes, absmax, q, 64, [101], torch.float32)
    with pytest.raises(backend.errors, match="block maxima"):
        backend.dequantize_blockwise(codes, absmax, q, 32, [100], torch.float32)
    with pytest.raises(backend.errors, match="code bytes"):
        backend.dequantize_blockwise(codes, absmax, qmap("signed", 4, backend.device), 64, [100], torch.float32)


def test_a_map_changed_in_place_is_checked_and_used_again(backend):
    """A map object is checked once and its midpoints kept (the launchers' caches) only until it is modified
    in place: then it is checked again and its new levels are used."""
    q = qmaps.signed(8).to(backend.device)
    x = randn((300,), device=backend.device)
    check(backend, "quantize_blockwise", x, q, 64, bitwise=True)
    q.mul_(0.5)                                   # still sorted: other midpoints
    check(backend, "quantize_blockwise", x, q, 64, bitwise=True)
    q[3] = 5.0                                    # no longer sorted
    with pytest.raises(backend.errors, match="strictly increasing"):
        backend.quantize_blockwise(x, q, 64)


# ------------------------------------------------------------------ the Python API
def test_api_round_trip_and_bytes():
    x = moment_like((3, 300), "signed", torch.bfloat16)
    q = K.quantize_blockwise(x, qmaps.signed(4), block_size=128)
    assert isinstance(q, K.BlockwiseTensor) and q.bits == 4 and q.shape == (3, 300) and q.dtype == torch.bfloat16
    assert q.nbytes == 450 + 4 * 8
    y = K.dequantize_blockwise(q)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(K.dequantize_blockwise(q, torch.float32),
                       reference.dequantize_blockwise(q.codes, q.absmax, q.qmap, 128, [3, 300], torch.float32))


def test_api_errors_name_the_fix():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="qmaps.signed"):
        K.quantize_blockwise(x, torch.linspace(-1, 1, 17))
    with pytest.raises(ValueError, match="block_size must be one of"):
        K.quantize_blockwise(x, qmaps.signed(8), block_size=100)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        K.quantize_blockwise(x.int(), qmaps.signed(8))
    with pytest.raises(TypeError, match="BlockwiseTensor"):
        K.dequantize_blockwise(K.quantize(x))
