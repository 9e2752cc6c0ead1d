"""Probe of the scheduler's public API with bad and extreme input: each case either works
(checked) or raises an error that names the argument. Nothing silently wrong."""
import math

import pytest
import torch
from torch import nn

from slimfit.scheduler import ILSScheduler, estimate_activation_bytes, min_rate_for_budget, num_frozen


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


BAD_CONSTRUCTIONS = [
    (dict(freeze_rate=1.0), ValueError, "freeze_rate"),
    (dict(freeze_rate=-0.1), ValueError, "freeze_rate"),
    (dict(freeze_rate=float("nan")), ValueError, "freeze_rate"),
    (dict(freeze_rate=float("inf")), ValueError, "freeze_rate"),
    (dict(score="l2"), ValueError, "score"),
    (dict(rounding="ceil"), ValueError, "rounding"),
    (dict(min_trained_steps=-1), ValueError, "min_trained_steps"),
    (dict(min_frozen_steps=1.5), ValueError, "min_frozen_steps"),
    (dict(memory_aware=True), ValueError, "activation_bytes"),
    (dict(budget_bytes=10.0), ValueError, "activation_bytes"),
    (dict(always_train=["nope"]), ValueError, "always_train"),
    (dict(always_train=["0", "2"]), ValueError, "every candidate"),
    (dict(frozen_update="sgd"), ValueError, "frozen_update"),
    (dict(warmup_steps=True), ValueError, "warmup_steps"),
    (dict(min_train_share=0.5, freeze_rate=0.9), ValueError, "min_train_share"),
    (dict(release_state_after=0), ValueError, "release_state_after"),
    (dict(layers=["0.weight", "missing.weight"]), ValueError, "layers"),
    (dict(layers=[]), ValueError, "empty"),
    (dict(chunk_numel=0), ValueError, "chunk_numel"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_CONSTRUCTIONS, ids=[str(k) for k, _, _ in BAD_CONSTRUCTIONS])
def test_bad_construction_is_refused_by_name(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ILSScheduler(_mlp(), **kwargs)


@pytest.mark.parametrize("what", [torch.ones(3), "model", [torch.ones(2, 2)], [("w", 3)]])
def test_not_a_model_or_named_parameters(what):
    with pytest.raises(TypeError, match="named_parameters|module"):
        ILSScheduler(what, 0.5)


def test_model_without_candidates():
    with pytest.raises(ValueError, match="no candidate layers"):
        ILSScheduler(nn.ReLU(), 0.5)
    frozen = _mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="no candidate layers"):
        ILSScheduler(frozen, 0.5)


def test_single_layer_always_trains():
    m = nn.Linear(2, 2)
    s = ILSScheduler(m, 0.99, warmup_steps=0)
    s.apply()
    assert s.num_frozen == 0 and m.weight.requires_grad


def test_step_after_close_and_set_rate_checks():
    s = ILSScheduler(_mlp(), 0.5)
    with pytest.raises(ValueError, match="freeze_rate"):
        s.set_freeze_rate(1.2)
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.step()


def test_state_of_another_model_is_refused():
    s = ILSScheduler(_mlp(), 0.5)
    other = ILSScheduler(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), 0.5)
    with pytest.raises(ValueError, match="does not match"):
        s.load_state_dict(other.state_dict())
    state = s.state_dict()
    state["version"] = 99
    with pytest.raises(ValueError, match="version"):
        s.load_state_dict(state)


def test_nan_weights_keep_training_instead_of_freezing_silently():
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    s = ILSScheduler(m, 0.5, optimizer=opt, min_train_share=0.0, warmup_steps=0)   # the scores alone choose
    for _ in range(4):                                # every layer gets a real score
        m(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        s.step()
    trained = s.trained_names()[0]
    with torch.no_grad():
        dict(m.named_parameters())[trained].fill_(float("nan"))
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    s.step()
    assert math.isnan(s.layer_scores()[trained]) or s.layer_scores()[trained] == math.inf
    assert trained in s.trained_names()               # NaN counts as "keep training", visible to the user


def test_budget_helpers_refuse_impossible_budgets():
    every = {"0.weight": 100, "1.weight": 100, "2.weight": 100}
    with pytest.raises(ValueError, match="budget"):
        ILSScheduler(_mlp(), 0.0, activation_bytes=every, budget_bytes=50.0, scheduled_kinds="all")
    s = ILSScheduler(_mlp(), 0.0, activation_bytes={"0.weight": 100, "2.weight": 100}, budget_bytes=50.0,
                     scheduled_kinds="all")
    assert s.trained_names() == ["1.weight"]          # only the layer that costs nothing fits
    rate = min_rate_for_budget([100.0, 100.0, 100.0], budget_bytes=250.0)
    assert 0.0 <= rate < 1.0 and num_frozen(rate, 3) >= 1
    with pytest.raises(ValueError):
        min_rate_for_budget([100.0, 100.0], budget_bytes=50.0)
    bytes_ = estimate_activation_bytes(_mlp(), torch.randn(5, 4))
    assert bytes_["0.weight"] == 5 * 4 * 4 and bytes_["2.weight"] == 5 * 8 * 4
