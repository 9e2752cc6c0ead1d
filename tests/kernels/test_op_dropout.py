"""slimfit::dropout_mask and seeded_dropout on every backend: bit for bit the reference (the mask keeps
element i when u(seed, i) >= p; kept values are x * fp32(1 / (1 - p))), reproducible per seed, the
keep rate 1 - p; errors."""
import pytest
import torch
from _backends import COMPARED, FLOATS, LAUNCHES, check, non_contiguous, randn

P_VALUES = [0.0, 0.1, 0.5, 0.5 + 1e-12, 0.3000000001, 0.9, 1.0]
SEEDS = [0, 123456789, 2**40 + 5]


@pytest.mark.backend_grid(reason=f"{COMPARED}; {LAUNCHES} (and its fp32 -> bf16 cast truncates)",
                          reference=False, interpreter={"dtype": (torch.float32, torch.float16)})
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_matches_reference(backend, dtype):
    shapes = backend.choose([(1,), (), (3, 77), (2, 3, 5), (0, 5), (1000,), (2, 4097)],
                            [(1,), (), (3, 333), (2, 4097), (0, 5)])
    for i, shape in enumerate(shapes):
        x = randn(shape, dtype, seed=20 + i, device=backend.device)
        for p in backend.choose(P_VALUES, [0.0, 0.1, 0.5 + 1e-12, 0.3000000001, 1.0]):
            for seed in backend.choose(SEEDS, [SEEDS[i % len(SEEDS)]]):
                check(backend, "dropout_mask", x, p, seed)
                check(backend, "seeded_dropout", x, p, seed)
    for x in backend.choose(non_contiguous(dtype, backend.device), non_contiguous(dtype, backend.device)[:1]):
        check(backend, "dropout_mask", x, 0.3, 11)
        check(backend, "seeded_dropout", x, 0.3, 11)
        check(backend, "seeded_dropout", x[:0], 0.3, 11)


def test_mask_of_any_dtype_and_keep_rate(backend):
    like = torch.empty(32_000, dtype=torch.int32, device=backend.device)  # < 32768: no intra-op threads on CPU
    keep, _ = check(backend, "dropout_mask", like, 0.25, 9)
    assert abs(keep.float().mean().item() - 0.75) < 0.01


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
def test_seeded_dropout_properties(backend, p):
    x = randn((50, 40), device=backend.device)
    y = backend.seeded_dropout(x, p, 11)
    keep = backend.dropout_mask(x, p, 11)
    assert torch.equal(y, backend.seeded_dropout(x, p, 11))
    assert not torch.equal(keep, backend.dropout_mask(x, p, 12)) or p in (0.0, 1.0)
    if p == 1.0:
        assert torch.equal(y, torch.zeros_like(x)) and not keep.any()
        return
    assert torch.equal(y != 0, keep & (x != 0))
    torch.testing.assert_close(y, torch.where(keep, x / (1 - p), 0.0), rtol=1e-6, atol=0)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.02


def test_invalid_arguments(backend):
    x = randn((100,), device=backend.device)
    for p in (1.5, -0.1, float("nan")):
        with pytest.raises(backend.errors, match="p must be"):
            backend.dropout_mask(x, p, 0)
        with pytest.raises(backend.errors, match="p must be"):
            backend.seeded_dropout(x, p, 0)
    with pytest.raises(backend.errors, match="dtype"):
        backend.seeded_dropout(x.to(torch.int32), 0.5, 0)
