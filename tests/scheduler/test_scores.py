"""Batched scores against the plain formulas."""
import math

import pytest
import torch

from slimfit.scheduler import compute_scores
from slimfit.scheduler.scores import NAIVE_SCORES as NAIVE
from slimfit.scheduler.scores import SCORES, relative_scores_naive


def _layers(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (1, 3), (33,), (4, 4, 3), (64, 17)]
    olds = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    news = [(o.float() + 1e-3 * torch.randn(o.shape, generator=g)).to(dtype) for o in olds]
    return olds, news


IMPLS = ["foreach", "blocked"]


@pytest.mark.parametrize("kind", SCORES)
@pytest.mark.parametrize("impl,chunk", [("foreach", 1), ("foreach", 50), ("foreach", 1 << 25), ("blocked", 0)])
def test_matches_naive(kind, impl, chunk, monkeypatch):
    import slimfit.scheduler.scores as S

    monkeypatch.setattr(S, "BLOCK_NUMEL", 16)          # many blocks, a short last one
    olds, news = _layers()
    got = compute_scores(kind, olds, news, chunk_numel=max(chunk, 1), impl=impl)
    assert got.dtype == torch.float64 and got.shape == (len(olds),)
    want = torch.tensor([NAIVE[kind](o, n) for o, n in zip(olds, news)], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_relative_is_the_paper_formula_without_zeros():
    olds, news = _layers(1)
    got = compute_scores("relative", olds, news)
    paper = torch.stack([((o - n) / o).abs().mean().double() for o, n in zip(olds, news)])
    torch.testing.assert_close(got, paper, rtol=1e-4, atol=0)   # fp32 sums, other order


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_entries_left_out(impl, monkeypatch):
    import slimfit.scheduler.scores as S

    monkeypatch.setattr(S, "BLOCK_NUMEL", 2)            # zeros in some blocks only
    old = torch.tensor([[0.0, 2.0], [4.0, 0.0]])
    new = torch.tensor([[5.0, 2.2], [4.0, 0.0]])     # change at a zero entry is ignored
    # kept entries: |0.2/2| = 0.1 and 0 -> mean 0.05
    assert compute_scores("relative", [old], [new], impl=impl).item() == pytest.approx(0.05, rel=1e-6)
    # all-zero layer: inf if it moved, 0 if not
    z = torch.zeros(3, 3)
    got = compute_scores("relative", [z, z, old], [z + 1e-3, z.clone(), old.clone()], impl=impl)
    assert got[0].item() == math.inf and got[1].item() == 0.0 and got[2].item() == 0.0
    got = compute_scores("robust", [z, z], [z + 1e-3, z.clone()], impl=impl)
    assert got[0].item() == math.inf and got[1].item() == 0.0
    assert torch.isfinite(compute_scores("robust", [old], [new], impl=impl)).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("kind", SCORES)
def test_low_and_high_precision(dtype, kind, impl):
    olds, news = _layers(2, dtype)
    got = compute_scores(kind, olds, news, impl=impl)
    want = torch.tensor([NAIVE[kind](o, n) for o, n in zip(olds, news)], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float64 else 1e-3, atol=0)


def test_mixed_dtypes_keep_order_and_empty():
    o1, n1 = _layers(3)
    o2, n2 = _layers(4, torch.float64)
    olds = [o1[0], o2[1], o1[2], o2[3]]
    news = [n1[0], n2[1], n1[2], n2[3]]
    got = compute_scores("relative", olds, news)
    want = torch.tensor([relative_scores_naive(o, n) for o, n in zip(olds, news)], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert compute_scores("relative", [], []).numel() == 0
    with pytest.raises(ValueError, match="score"):
        compute_scores("l1", olds, news)


def test_fast_and_zero_aware_paths_agree_bit_for_bit():
    from slimfit.scheduler.scores import relative_scores, relative_scores_masked

    olds, news = _layers(6)
    olds = [o * 1e-3 for o in olds]              # small weights: no cancellation allowed
    assert torch.equal(relative_scores(olds, news), relative_scores_masked(olds, news))


def test_zero_layers_flagged_once():
    olds, news = _layers(7)
    olds[1] = olds[1].clone()
    olds[1][0, 0] = 0.0                          # an embedding's zero padding entry, say
    news[1] = news[1].clone()
    news[1][0, 0] = 0.0
    flags = [False] * len(olds)
    transfers = _count_cpu(lambda: compute_scores("relative", olds, news, zero_flags=flags, impl="foreach"))
    assert flags == [False, True, False, False, False] and len(transfers) == 2   # fast, then the redo
    got = compute_scores("relative", olds, news, zero_flags=flags, impl="foreach")
    want = torch.tensor([relative_scores_naive(o, n) for o, n in zip(olds, news)], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert len(_count_cpu(lambda: compute_scores("relative", olds, news, zero_flags=flags, impl="foreach"))) == 1


def _count_cpu(fn):
    calls = []
    orig = torch.Tensor.cpu

    def counting_cpu(self, *a, **k):
        calls.append(self.shape)
        return orig(self, *a, **k)

    torch.Tensor.cpu = counting_cpu
    try:
        fn()
    finally:
        torch.Tensor.cpu = orig
    return calls


def test_one_host_transfer_per_step():
    """The per-layer values stay on the device until a single .cpu() of the stacked vector."""
    olds, news = _layers(5)
    calls = []
    orig = torch.Tensor.cpu

    def counting_cpu(self, *a, **k):
        calls.append(self.shape)
        return orig(self, *a, **k)

    torch.Tensor.cpu = counting_cpu
    try:
        compute_scores("relative", olds, news, chunk_numel=64, impl="foreach")   # several chunks
    finally:
        torch.Tensor.cpu = orig
    assert calls == [(len(olds),)]


@pytest.mark.parametrize("impl", IMPLS)
def test_refresh_copies_new_into_snapshot(impl):
    olds, news = _layers(8)
    snaps = [o.clone() for o in olds]
    got = compute_scores("relative", snaps, news, refresh=True, impl=impl)
    want = compute_scores("relative", olds, news, impl=impl)
    assert torch.equal(got, want)
    assert all(torch.equal(s, n) for s, n in zip(snaps, news))
    assert compute_scores("relative", snaps, news, impl=impl).abs().sum() == 0


def test_blocked_and_foreach_agree():
    olds, news = _layers(9)
    for kind in SCORES:
        a = compute_scores(kind, olds, news, impl="foreach")
        b = compute_scores(kind, olds, news, impl="blocked")
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="impl"):
        compute_scores("relative", olds, news, impl="fast")


@pytest.mark.parametrize("impl", IMPLS)
def test_absolute_ignores_weight_size(impl):
    """The same Adam-like step on a LayerNorm-like weight (about 1) and a linear-like weight
    (about 0.05) scores the same under 'absolute'; the relative scores rank them by size."""
    g = torch.Generator().manual_seed(11)
    ln = 1.0 + 0.1 * torch.randn(384, generator=g)
    lin = 0.05 * torch.randn(64, 384, generator=g)
    step_ln = 1e-4 * torch.randn(ln.shape, generator=g).sign()
    step_lin = 1e-4 * torch.randn(lin.shape, generator=g).sign()
    olds, news = [ln, lin], [ln + step_ln, lin + step_lin]
    absolute = compute_scores("absolute", olds, news, impl=impl)
    torch.testing.assert_close(absolute, torch.full((2,), 1e-4, dtype=torch.float64), rtol=1e-3, atol=0)
    relative = compute_scores("relative", olds, news, impl=impl)
    assert relative[1] > 10 * relative[0]
    assert compute_scores("absolute", [torch.zeros(0)], [torch.zeros(0)], impl="blocked").item() == 0.0


@pytest.mark.parametrize("kind", SCORES)
def test_sharded_partial_sums_add_up_to_the_whole_score(kind):
    """FSDP2 path: partial sums of two shards, added, finish to the score of the whole tensor."""
    from slimfit.scheduler.sharded import _finish, _partial_sums

    olds, news = _layers(12)
    old, new = olds[4], news[4]
    halves = [_partial_sums(kind, o, n) for o, n in zip(old.chunk(2), new.chunk(2))]
    summed = [a + b for a, b in zip(*halves)]
    assert _finish(kind, *summed) == pytest.approx(NAIVE[kind](old, new), rel=1e-9)
