"""Selection logic: exact counts, round-robin start, stale scores, lowest frozen."""
import math

import pytest
import torch
from torch import nn

from slimfit.scheduler import ILSScheduler, num_frozen
from slimfit.scheduler.selection import choose_trained, training_order


class Bank(nn.Module):
    """L independent 'layers' (2x2 weights of ones) whose updates the test dictates."""

    def __init__(self, L):
        super().__init__()
        self.w = nn.ParameterList([nn.Parameter(torch.ones(2, 2)) for _ in range(L)])


def names(L):
    return [f"w.{i}" for i in range(L)]


def move(bank, sched, rel):
    """Move each trained layer by the relative update rel[i] (its exact relative score)."""
    with torch.no_grad():
        for i, p in enumerate(bank.w):
            if p.requires_grad:
                p.mul_(1.0 + rel[i])


@pytest.mark.parametrize("L", [1, 2, 7, 10, 101])
@pytest.mark.parametrize("rate", [0.0, 0.25, 0.5, 0.8, 0.9, 0.95])
def test_exact_counts(L, rate):
    bank = Bank(L)
    s = ILSScheduler(bank, freeze_rate=rate, warmup_steps=0)
    expect = min(math.floor(rate * L + 0.5), L - 1)
    # The decision is made at construction, applied when training starts (here: by hand).
    assert all(p.requires_grad for p in bank.w)
    s.apply()
    for _ in range(4):
        assert s.num_frozen == expect == len(s.frozen_names())
        assert sum(p.requires_grad for p in bank.w) == L - expect
        move(bank, s, [0.01 * (i + 1) for i in range(L)])
        s.step()


def test_num_frozen_rounding_and_errors():
    assert num_frozen(0.9, 101) == 91            # round(90.9)
    assert num_frozen(0.9, 101, "floor") == 90   # int() as in the paper's code
    assert num_frozen(0.25, 10) == 3             # 2.5 rounds half up
    assert num_frozen(0.99, 10) == 9             # never all: one layer always trains
    for bad in (-0.1, 1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="freeze_rate"):
            num_frozen(bad, 10)
    with pytest.raises(ValueError, match="rounding"):
        num_frozen(0.5, 10, "ceil")


def test_round_robin_start_covers_all_layers():
    L, rate = 20, 0.9   # 2 layers train per step: 10 steps to see every layer once
    bank = Bank(L)
    s = ILSScheduler(bank, freeze_rate=rate, seed=3, warmup_steps=0)
    trained_sets = []
    for _ in range(10):
        trained_sets.append(tuple(s.trained_names()))
        move(bank, s, [1e-3] * L)
        s.step()
    flat = [n for t in trained_sets for n in t]
    assert sorted(flat) == sorted(names(L))      # each layer exactly once
    # the order is seeded: same seed, same order; another seed, another order
    def order(seed):
        b = Bank(L)
        s = ILSScheduler(b, freeze_rate=rate, seed=seed, warmup_steps=0)
        out = []
        for _ in range(10):
            out.append(tuple(s.trained_names()))
            move(b, s, [1e-3] * L)
            s.step()
        return out
    assert order(3) == trained_sets
    other = order(4)
    assert other != trained_sets and sorted(n for t in other for n in t) == sorted(names(L))


def test_lowest_scores_frozen_and_stale_scores_kept():
    L = 10
    bank = Bank(L)
    s = ILSScheduler(bank, freeze_rate=0.5, warmup_steps=0)
    rel = [0.001 * (i + 1) for i in range(L)]    # layer i moves by (i+1)e-3
    for _ in range(2):                            # round robin: 5 + 5 layers
        move(bank, s, rel)
        s.step()
    sc = s.layer_scores()
    for i in range(L):
        assert sc[f"w.{i}"] == pytest.approx(rel[i], rel=1e-3)
    # the five lowest-scoring layers are frozen
    assert sorted(s.frozen_names()) == [f"w.{i}" for i in range(5)]
    # stale scores: a frozen layer's score does not change, even if its weight is moved by hand
    with torch.no_grad():
        bank.w[0].mul_(3.0)
    new_rel = [0.0] * L
    for i in range(5, L):
        new_rel[i] = 1e-5                          # trained layers now barely move
    move(bank, s, new_rel)
    s.step()
    sc2 = s.layer_scores()
    assert all(sc2[f"w.{i}"] == sc[f"w.{i}"] for i in range(5))          # stale
    assert all(sc2[f"w.{i}"] == pytest.approx(1e-5, rel=0.1) for i in range(5, L))
    # now layers 5..9 score lowest (1e-5 < 1e-3) and get frozen; 0..4 train again
    assert sorted(s.frozen_names()) == [f"w.{i}" for i in range(5, L)]


def test_training_order_unseen_first_then_priority():
    scores = torch.tensor([5.0, 1e7, 3.0, 2e7, 3.0], dtype=torch.float64)
    seen = torch.tensor([True, False, True, False, True])
    assert training_order(scores, seen) == [3, 1, 0, 2, 4]   # ties by index
    b = torch.tensor([10.0, 1, 1.0, 1, 0.0], dtype=torch.float64)
    # memory-aware: score per byte: 0.5, 3.0, inf(0 bytes) -> 4, 2, 0
    assert training_order(scores, seen, b, memory_aware=True) == [3, 1, 4, 2, 0]
    nan = torch.tensor([float("nan"), 1.0], dtype=torch.float64)
    assert training_order(nan, torch.tensor([True, True])) == [0, 1]  # NaN counts as +inf


def test_choose_trained_budget_and_soft_constraints():
    order = [0, 1, 2, 3]
    assert choose_trained(order, 2) == [0, 1]
    # budget: 0 does not fit, 1 and 2 do, 3 would exceed
    assert choose_trained(order, 4, bytes_=[100, 10, 20, 80], budget=40) == [1, 2]
    assert choose_trained(order, 2, must_train=[False, False, True, True]) == [2, 3]
    assert choose_trained(order, 2, must_freeze=[True, False, False, False]) == [1, 2]
    # must_freeze yields when too few layers are left
    assert choose_trained(order, 4, must_freeze=[True, True, False, False]) == [0, 1, 2, 3]


def test_min_trained_and_frozen_steps():
    L = 10
    bank = Bank(L)
    s = ILSScheduler(bank, freeze_rate=0.8, min_trained_steps=3, min_train_share=0.0, warmup_steps=0)
    first = s.trained_names()
    for _ in range(2):
        move(bank, s, [1e-3] * L)
        s.step()
        assert s.trained_names() == first        # kept for 3 steps although others are unseen
    move(bank, s, [1e-3] * L)
    s.step()
    assert set(s.trained_names()).isdisjoint(first)

    bank = Bank(L)
    s = ILSScheduler(bank, freeze_rate=0.5, min_frozen_steps=3, min_train_share=0.0, warmup_steps=0)
    rel = [0.001 * (i + 1) for i in range(L)]
    for _ in range(2):                           # round robin 5 + 5
        move(bank, s, rel)
        s.step()
    frozen = set(s.frozen_names())               # just frozen after their first training
    move(bank, s, [1.0] * L)                     # make trained layers look important...
    s.step()
    # ... yet layers frozen less than 3 steps ago stay frozen where the count allows
    assert frozen & set(s.frozen_names())
