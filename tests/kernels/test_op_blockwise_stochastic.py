"""slimfit::quantize_blockwise with stochastic=True on every backend: bit for bit the reference for the same
seed (codes and block maxima), the uniforms the linear quantize draws (rng.uniform at the flat element index),
always one of the two levels around y = x / absmax (a level kept, the unsigned map's bottom taken, the top
kept), and unbiased: the mean restored value over many seeds approaches the input within a Hoeffding bound
of the seed count. The nearest mode's tests are test_op_blockwise.py."""
import math

import pytest
import torch
from _backends import COMPARED, FLOATS, LAUNCHES, assert_same, check, non_contiguous

from slimfit import kernels as K
from slimfit.kernels import qmaps, reference, rng

MAPS = [("signed", 8), ("signed", 4), ("unsigned", 8), ("unsigned", 4)]
MAP_IDS = [f"{kind}{bits}" for kind, bits in MAPS]
SEEDS = [0, 7, 2**40 + 3, 2**63 - 1]
SHAPES = [(), (1,), (7,), (3, 77), (2, 3, 5), (4, 256), (1000,), (5, 300), (2 * 4096 + 77,)]
INTERPRETER_SHAPES = [(), (37,), (3, 100), (2 * 1024 + 33,)]


def moment_like(n, kind, seed=0):
    """n values spread over 20 decades (as optimizer moments are), exact zeros; non-negative for "unsigned"."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.empty(n).uniform_(-18, 2, generator=g))
    x[::11] = 0.0
    return x.abs() if kind == "unsigned" else x


def scaled(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, absmax per element) as the specification computes them in fp32: y = x * (1 / absmax)."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    padded = torch.cat([flat, flat.new_zeros(-n % block_size)]).view(-1, block_size)
    absmax = padded.abs().amax(1)
    inv = torch.where(absmax >= 2.0**-126, 1.0 / absmax, torch.zeros_like(absmax))
    return (padded * inv[:, None]).reshape(-1)[:n], absmax.repeat_interleave(block_size)[:n]


def brackets(y: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In float64: the index of the level at or below y (0 below the smallest) and of the one above it (the
    same index at the top, or where y is a level: nothing else may be chosen)."""
    lv, y = q.double(), y.double()
    lo = (torch.searchsorted(lv, y, right=True) - 1).clamp_min(0)
    exact = lv[lo] == y
    hi = torch.where(exact | (y < lv[0]), lo, (lo + 1).clamp_max(lv.numel() - 1))
    return lo, hi


def codes_of(backend, x, q, block_size, seed):
    codes, absmax = backend.quantize_blockwise(x.to(backend.device), q.to(backend.device), block_size, True, seed)
    return reference._unpack_codes(codes.cpu(), qmaps.bits_of(q), x.numel()), absmax.cpu()


@pytest.mark.backend_grid(reason=f"{COMPARED}; {LAUNCHES}", reference=False,
                          interpreter={"block_size": (32, 4096), "dtype": (torch.float32, torch.bfloat16)})
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("block_size", [32, 64, 256, 4096])
@pytest.mark.parametrize("kind,bits", MAPS, ids=MAP_IDS)
def test_stochastic_codes_match_the_reference_bit_for_bit(backend, kind, bits, block_size, dtype):
    q = qmaps.MAPS[kind](bits).to(backend.device)
    for i, shape in enumerate(backend.choose(SHAPES, INTERPRETER_SHAPES)):
        x = moment_like(math.prod(shape), kind, seed=i).view(shape).to(dtype).to(backend.device)
        for seed in backend.choose(SEEDS, SEEDS[1:3]):
            check(backend, "quantize_blockwise", x, q, block_size, True, seed, bitwise=True)
    if kind == "signed":   # transposed and strided views: flattened in their logical order
        for x in backend.choose(non_contiguous(dtype, backend.device), []):
            got, _ = check(backend, "quantize_blockwise", x, q, block_size, True, 5, bitwise=True)
            assert_same(got, backend.quantize_blockwise(x.contiguous(), q, block_size, True, 5), "contiguous copy")


def _dyadic_map() -> torch.Tensor:
    """256 levels k / 128 - 1 (exact in fp32, gaps 1/128: every t below is exact)."""
    return torch.arange(256, dtype=torch.float32) / 128 - 1


@pytest.mark.parametrize("seed", [0, 12345, 2**62 + 7])
def test_stochastic_codes_draw_the_linear_code_s_uniforms(backend, seed):
    """On a map whose gaps are exact, y at a quarter, half and three quarters of a gap takes the upper level
    exactly when rng.uniform(seed, i) < t, i the flat element index across blocks (the counter layout of
    quantize's stochastic rounding); the same seed gives the same codes, another seed others."""
    g = torch.Generator().manual_seed(1)
    n = backend.choose(3 * 4096, 2 * 64)
    k = torch.randint(0, 255, (n,), generator=g)
    t = torch.tensor([0.25, 0.5, 0.75])[torch.randint(0, 3, (n,), generator=g)]
    x = (k.float() + t) / 128 - 1
    x[:: backend.choose(4096, 64)] = 1.0                # each block's absmax is 1: y = x, exactly
    k[:: backend.choose(4096, 64)], t[:: backend.choose(4096, 64)] = 255, 0.0   # 1.0: above the top level
    codes, _ = codes_of(backend, x, _dyadic_map(), backend.choose(4096, 64), seed)
    u = rng.uniform(seed, n, "cpu")
    assert torch.equal(codes, k + (u < t).long())
    again, _ = codes_of(backend, x, _dyadic_map(), backend.choose(4096, 64), seed)
    other, _ = codes_of(backend, x, _dyadic_map(), backend.choose(4096, 64), seed + 1)
    assert torch.equal(again, codes) and not torch.equal(other, codes)


@pytest.mark.backend_grid(reason=LAUNCHES, interpreter={"bits": (4,)})
@pytest.mark.parametrize("kind,bits", MAPS, ids=MAP_IDS)
def test_stochastic_code_is_one_of_the_two_levels_around_y(backend, kind, bits):
    """Every code is the level at or below y or the one above; y on a level (every level, 0 and 1 among
    them) keeps it; y below the unsigned map's smallest level takes that level; NaN-free input only."""
    q = qmaps.MAPS[kind](bits)
    n = backend.choose(8 * 512, 4 * 512)
    x = moment_like(n, kind, seed=3)
    x[512:1536] = x[512:1536].clamp(-0.5, 0.5)
    x[512:512 + q.numel()] = q                             # a block whose absmax is 1: y = the levels
    x[1024:1024 + 40] = 1e-30 * torch.arange(40)           # tiny next to 1: y below every nonzero level
    x[1024 + 40] = 1.0
    y, _ = scaled(x, 512)
    lo, hi = brackets(y, q)
    for seed in (0, 99):
        codes, _ = codes_of(backend, x, q, 512, seed)
        assert bool(((codes == lo) | (codes == hi)).all())
        assert torch.equal(codes[512:512 + q.numel()], torch.arange(q.numel()))
        below = y.double() < float(q[0])
        assert bool((codes[below] == 0).all()) and int(below.sum()) >= (40 if kind == "unsigned" else 0)
        between = lo != hi                                  # both levels are drawn there
        assert bool((codes == hi)[between].any()) and bool((codes == lo)[between].any())


def _hoeffding(count: int, delta: float, tests: int) -> float:
    """eps with P(|mean - E| >= eps) <= delta over ``tests`` means of ``count`` independent [0, 1] draws."""
    return math.sqrt(math.log(2 * tests / delta) / (2 * count))


@pytest.mark.backend_grid(reason="draws many seeds: the reference and C++ (the others are bit for bit the "
                          "reference: test_stochastic_codes_match_the_reference_bit_for_bit)", interpreter=False,
                          cuda=False)
@pytest.mark.parametrize("kind,bits", MAPS, ids=MAP_IDS)
def test_stochastic_rounding_is_unbiased(backend, kind, bits):
    """Each restored value is the lower or upper level (gap d), the upper with probability p = t up to 2**-24;
    so over N seeds the mean is within eps * d of E = x by Hoeffding (eps from N and the element count, a
    chance below 1e-6 of a false failure), plus fp32 rounding of y, t and the restore (2**-21 of absmax).
    Nearest rounding misses that by up to d / 2. Over all elements and seeds the mean error in gaps is
    within its own, tighter Hoeffding bound. Values below the unsigned map's smallest level are raised to it
    (never restored lower: no zero level), so they are left out."""
    q = qmaps.MAPS[kind](bits)
    n, seeds, block = 2048, 1000, 256
    x = moment_like(n, kind, seed=11)
    y, a = scaled(x, block)
    lo, hi = brackets(y, q)
    d = (q.double()[hi] - q.double()[lo]) * a.double()
    total = torch.zeros(n, dtype=torch.float64)
    for s in range(seeds):
        codes, absmax = backend.quantize_blockwise(x, q, block, True, s)
        total += backend.dequantize_blockwise(codes, absmax, q, block, [n], torch.float32).double()
    mean, inside = total / seeds, (y.double() >= float(q[0])) & (d > 0)
    assert int(inside.sum()) > n // 4
    err = (mean - x.double())[inside]
    eps = _hoeffding(seeds, 1e-6, int(inside.sum()))
    assert bool((err.abs() <= eps * d[inside] + 2**-21 * a.double()[inside]).all()), float((err / d[inside]).max())
    eps_all = math.sqrt(2 * math.log(2 / 1e-6) / (seeds * int(inside.sum())))   # range [-1, 1] per draw
    assert abs(float((err / d[inside]).mean())) <= eps_all + 2**-16
    assert eps < 0.11 and eps_all < 0.01         # the bounds are far below nearest rounding's d / 2


def test_api_stochastic_and_seed():
    """slimfit.kernels.quantize_blockwise(stochastic=True, seed=s) is the op's codes for s; without a seed one
    is drawn from torch's generator (torch.manual_seed repeats it); a non-bool flag is refused."""
    x = moment_like(3 * 300, "signed").view(3, 300)
    q = qmaps.signed(8)
    got = K.quantize_blockwise(x, q, 128, stochastic=True, seed=9)
    assert torch.equal(got.codes, torch.ops.slimfit.quantize_blockwise(x, q, 128, True, 9)[0])
    torch.manual_seed(4)
    a = K.quantize_blockwise(x, q, 128, stochastic=True)
    torch.manual_seed(4)
    b = K.quantize_blockwise(x, q, 128, stochastic=True)
    assert torch.equal(a.codes, b.codes) and not torch.equal(a.codes, K.quantize_blockwise(x, q, 128).codes)
    assert torch.equal(K.quantize_blockwise(x, q, 128).codes, torch.ops.slimfit.quantize_blockwise(x, q, 128)[0])
    with pytest.raises(TypeError, match="stochastic"):
        K.quantize_blockwise(x, q, 128, stochastic="yes")
    with pytest.raises(ValueError, match="seed"):
        K.quantize_blockwise(x, q, 128, stochastic=True, seed=-1)
