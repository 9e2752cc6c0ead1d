"""slimfit::round_stochastic on every backend: bit for bit the reference (bfloat16: one ulp away from zero
with probability low-16-bits / 2**16 from the element's word; float16: the upper neighbour with probability
(x - lo) / (hi - lo) from its uniform; the nearest where x or its nearest rounding is not finite),
reproducible per seed, unbiased, representable values kept; errors."""
import pytest
import torch
from _backends import COMPARED, LAUNCHES, check, non_contiguous, randn

ROUNDED = [torch.bfloat16, torch.float16]
SEEDS = [0, 123456789, 2**40 + 5]


def _edges() -> torch.Tensor:
    """Zeros of both signs, infinities, NaNs of both signs, the formats' largest values and the values just
    past them (some round to infinity, some do not), tiny and subnormal values, exact representables."""
    f16max, bf16max = 65504.0, float(torch.finfo(torch.bfloat16).max)
    vals = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), f16max, -f16max, 65519.0,
            65520.0, -65520.0, bf16max, -bf16max, 3.3961e38, 3.4e38, -3.4e38, 1e-40, -1e-40, 6e-8, -3e-8, 1e-8,
            1.0, -1.0, 1.00390625, 0.1, -0.1, 2.0**-24, 2.0**-14, -2.0**-14]
    return torch.tensor(vals, dtype=torch.float32)


@pytest.mark.backend_grid(reason=f"{COMPARED}; {LAUNCHES}", reference=False)
@pytest.mark.parametrize("dtype", ROUNDED, ids=str)
def test_matches_reference(backend, dtype):
    shapes = backend.choose([(1,), (), (3, 77), (2, 3, 5), (0, 5), (1000,), (2, 4097)],
                            [(1,), (), (3, 333), (0, 5)])
    for i, shape in enumerate(shapes):
        x = randn(shape, seed=30 + i, device=backend.device)
        for seed in backend.choose(SEEDS, [SEEDS[i % len(SEEDS)]]):
            check(backend, "round_stochastic", x, dtype, seed)
    for seed in SEEDS:
        check(backend, "round_stochastic", _edges().to(backend.device), dtype, seed)
    for x in backend.choose(non_contiguous(torch.float32, backend.device),
                            non_contiguous(torch.float32, backend.device)[:1]):
        check(backend, "round_stochastic", x, dtype, 11)


@pytest.mark.parametrize("dtype", ROUNDED, ids=str)
def test_unbiased_reproducible_and_exact_values_kept(backend, dtype):
    """A value a fifth of the way between two neighbours rounds up about a fifth of the time (the mean is the
    value); the same seed gives the same result, another seed another; representable values stay."""
    lo = torch.tensor(1.0, dtype=dtype)
    hi = torch.nextafter(lo, torch.tensor(2.0, dtype=dtype))
    x = torch.full((20_000,), float(lo) + 0.2 * (float(hi) - float(lo)), device=backend.device)
    y = backend.round_stochastic(x, dtype, 5)
    assert set(y.float().unique().tolist()) == {float(lo), float(hi)}
    assert abs((y == hi.to(y.device)).float().mean().item() - 0.2) < 0.015
    assert torch.equal(y, backend.round_stochastic(x, dtype, 5))
    assert not torch.equal(y, backend.round_stochastic(x, dtype, 6))
    exact = randn((500,), seed=4, device=backend.device).to(dtype).float()
    assert torch.equal(backend.round_stochastic(exact, dtype, 5), exact.to(dtype))


def test_invalid_arguments(backend):
    x = randn((10,), device=backend.device)
    with pytest.raises(backend.errors, match="float32"):
        backend.round_stochastic(x.to(torch.bfloat16), torch.bfloat16, 0)
    with pytest.raises(backend.errors, match="bfloat16 or float16"):
        backend.round_stochastic(x, torch.float32, 0)
