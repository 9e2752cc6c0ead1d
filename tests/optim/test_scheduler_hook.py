"""ILSScheduler.register_frozen_set_hook: the one entry point slimfit.optim uses in the scheduler."""
import pytest
import torch
from _optim_models import build, data, train

from slimfit.scheduler import ILSScheduler


def _ids(params):
    return {id(p) for p in params}


def test_hook_sees_every_applied_frozen_set():
    model = build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = ILSScheduler(model, freeze_rate=0.5, warmup_steps=0)   # no optimizer: the set applies at the first forward
    calls = []
    handle = sched.register_frozen_set_hook(lambda frozen, trained: calls.append((_ids(frozen), _ids(trained))))
    assert calls == []                                   # nothing applied yet
    sched.attach_optimizer(opt)                          # applies the first set
    assert len(calls) == 1
    for _ in range(3):
        train(model, opt, data(), 1, sched=sched)
        frozen = _ids(p for p in sched.params if not p.requires_grad)
        assert calls[-1] == (frozen, _ids(sched.params) - frozen)
    assert len(calls) == 4
    state = sched.state_dict()
    sched.load_state_dict(state)
    assert len(calls) == 5
    late = []
    sched.register_frozen_set_hook(lambda frozen, trained: late.append(len(frozen)))
    assert late == [sched.num_frozen]                    # a set in force is reported at once, to the new hook only
    assert len(calls) == 5
    handle.remove()
    train(model, opt, data(), 1, sched=sched)
    assert len(calls) == 5 and len(late) == 2
    sched.close()
    assert late[-1] == 0                                 # close: nothing frozen


def test_skipped_step_calls_no_hook():
    model = build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt)
    calls = []
    sched.register_frozen_set_hook(lambda frozen, trained: calls.append(1))
    sched.step()                                         # the optimizer did not step: nothing changes
    assert calls == [1] and sched.skipped_steps == 1


def test_hook_must_be_callable():
    sched = ILSScheduler(build(0), freeze_rate=0.5)
    with pytest.raises(TypeError, match="callable"):
        sched.register_frozen_set_hook("not a function")
