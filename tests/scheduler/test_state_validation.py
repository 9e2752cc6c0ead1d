"""ILSScheduler.load_state_dict checks the whole state before loading any of it: a state that does not fit
raises a ValueError naming what is wrong and the fix, and the scheduler is left exactly as it was. (Before,
a corrupted state failed deep inside, e.g. RuntimeError "shape '[4]' is invalid for input of size 5", after
part of the state had been loaded.)"""
import pytest
import torch
from _models import MLP, regression_data
from torch import nn

from slimfit.scheduler import ILSScheduler

FIX = r"; pass the dict ILSScheduler\.state_dict\(\) returned for this model"


def _trained_scheduler(steps=3):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = ILSScheduler(model, 0.6, optimizer=opt, scheduled_kinds="all", always_train=())
    x, y = regression_data()
    for _ in range(steps):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def _changed(state, **changes):
    out = dict(state)
    for key, value in changes.items():
        if value is KeyError:
            out.pop(key)
        else:
            out[key] = value
    return out


def _corruptions(good, model):
    L = len(good["names"])
    return {
        "not a dict": ([good], "expects the dict from ILSScheduler.state_dict"),
        "a model's state_dict": (model.state_dict(), r"no 'version'.*a model's or an optimizer's state_dict"),
        "unknown version": (_changed(good, version=2), r"state version 2 is unknown.*start the schedule afresh"),
        "version as a string": (_changed(good, version="1"), "state version '1' is unknown"),
        "a key missing": (_changed(good, scores=KeyError), r"the state lacks \['scores'\]" + FIX),
        "one score too many": (_changed(good, scores=torch.zeros(L + 1, dtype=torch.float64)),
                               rf"'scores' has shape \[{L + 1}\], not \[{L}\]: one entry per layer.*" + FIX),
        "scores 2-D": (_changed(good, scores=torch.zeros(1, L, dtype=torch.float64)), r"'scores' has shape \[1, "),
        "scores not numbers": (_changed(good, scores="high"), "'scores' must be a tensor of"),
        "trained as floats": (_changed(good, trained=good["trained"].float()), "'trained' must hold bools"),
        "seen as ints": (_changed(good, seen=good["seen"].long()), "'seen' must hold bools"),
        "nothing trained": (_changed(good, trained=torch.zeros(L, dtype=torch.bool)), "trains no layer"),
        "negative age": (_changed(good, age=-good["age"] - 1), r"'age' must hold ints >= 0, got the negative"),
        "age as floats": (_changed(good, age=good["age"].float()), "'age' must hold ints >= 0, got a tensor of"),
        "train_count too short": (_changed(good, train_count=good["train_count"][:-1]), "'train_count' has shape"),
        "step as a string": (_changed(good, step="3"), "'step' must be an int >= 0"),
        "step as a bool": (_changed(good, step=True), "'step' must be an int >= 0"),
        "negative skipped_steps": (_changed(good, skipped_steps=-1), "'skipped_steps' must be an int >= 0"),
        "names as a string": (_changed(good, names="fc1.weight"), "'names' must be a list of layer names"),
        "names of another model": (_changed(good, names=good["names"][:-1]),
                                   r"does not match this model's candidate layers.*start the schedule afresh"),
        "names renamed": (_changed(good, names=["x"] + good["names"][1:]),
                          r"not in this model: \['x'\]\); build the scheduler with the model and options of the "),
        "another shape": (_changed(good, shapes=[(1, 1)] + good["shapes"][1:]),
                          r"different shapes: 'fc1.weight' is \[1, 1\] in the state"),
        "shapes not shapes": (_changed(good, shapes=3), "'shapes' must be a list of parameter shapes"),
        "zero_flags too short": (_changed(good, zero_flags=[False]), f"'zero_flags' must be a list of {L} bools"),
        "config not a dict": (_changed(good, config=["freeze_rate"]), "'config' must be a dict"),
        "snapshot missing": (_changed(good, snapshots={"x": torch.zeros(1)}), r"'snapshots' must hold a tensor"),
    }


def _snapshot_of(model, sched):
    return ({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sched.state_dict(True).items()},
            [p.requires_grad for p in model.parameters()], {k: v.clone() for k, v in sched._snap.items()})


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


CASES = ("not a dict", "a model's state_dict", "unknown version", "version as a string", "a key missing",
         "one score too many", "scores 2-D", "scores not numbers", "trained as floats", "seen as ints",
         "nothing trained", "negative age", "age as floats", "train_count too short", "step as a string",
         "step as a bool", "negative skipped_steps", "names as a string", "names of another model", "names renamed",
         "another shape", "shapes not shapes", "zero_flags too short", "config not a dict", "snapshot missing")


@pytest.mark.parametrize("what", CASES)
def test_a_corrupted_state_is_named_and_changes_nothing(what):
    model, opt, sched = _trained_scheduler()
    good = sched.state_dict(include_snapshots=True)
    before = _snapshot_of(model, sched)
    cases = _corruptions(good, model)
    assert set(cases) == set(CASES)
    state, match = cases[what]
    with pytest.raises(ValueError, match=match):
        sched.load_state_dict(state)
    assert _same(_snapshot_of(model, sched), before), f"{what}: the failed load changed the scheduler"
    sched.load_state_dict(good)                              # the good state still loads, and training goes on
    assert _same(_snapshot_of(model, sched), before)
    x, y = regression_data()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    sched.step()
    assert sched.step_count == 4


def test_a_state_from_a_fresh_scheduler_of_another_size_is_refused_before_any_change():
    _, _, small = _trained_scheduler()
    state = small.state_dict()
    state["scores"] = torch.cat([state["scores"], torch.zeros(1, dtype=torch.float64)])   # 5 layers, 6 scores
    model, _, sched = _trained_scheduler(steps=1)
    frozen = sched.frozen_names()
    with pytest.raises(ValueError, match=r"'scores' has shape \[6\], not \[5\]"):
        sched.load_state_dict(state)
    assert sched.frozen_names() == frozen and sched.step_count == 1
