"""SchedulerConfig.state_code reaches the held moments: "dynamic8" / "dynamic4" hold every layer's AdamW moments
(compress_all) or the frozen layers' (compress) in block-wise dynamic codes, "linear8" in per-group min/max codes;
a held step is torch's step from the decoded moments whatever the code (tests/optim/test_codec_dynamic.py)."""
import pytest
import torch
from _optim_models import build, data, loss_of

from slimfit.optim import codec
from slimfit.optim.keys import Q8
from slimfit.scheduler import ILSScheduler, SchedulerConfig


def _entries(state_code, frozen_state="compress_all", steps=3):
    model = build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, seed=0, frozen_state=frozen_state,
                         state_code=state_code)
    for s in range(steps):
        loss_of(model, data(seed=s)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return [v for st in opt.state.values() for k, v in st.items() if k.endswith(Q8)], sched


@pytest.mark.parametrize("state_code,code,bits", [("linear8", "linear", 8), ("dynamic8", "dynamic", 8),
                                                  ("dynamic4", "dynamic", 4)])
@pytest.mark.parametrize("frozen_state", ["compress_all", "compress"])
def test_the_held_entries_are_coded_as_state_code_says(state_code, code, bits, frozen_state):
    entries, sched = _entries(state_code, frozen_state)
    assert entries and all(codec.is_encoded(e) for e in entries)
    assert {(codec.code_of(e)["code"], codec.code_of(e)["bits"]) for e in entries} == {(code, bits)}
    assert sched.config.state_code == state_code


def test_a_bad_state_code_is_named_with_the_choices():
    with pytest.raises(ValueError, match=r"SchedulerConfig.state_code must be one of .*did you mean 'dynamic8'"):
        SchedulerConfig(state_code="dynamic_8")
    assert SchedulerConfig.from_dict(SchedulerConfig(state_code="dynamic4").to_dict()).state_code == "dynamic4"


def test_a_scheduler_whose_optimizer_was_dropped_steps_and_closes():
    """ILSScheduler(model, optimizer=torch.optim.AdamW(...)) with no other reference: the optimizer is collected,
    and the scheduler's frozen sets and close() carry on without it (no state is left to hold)."""
    import gc

    model = build(0)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    gc.collect()
    sched.apply()
    sched.close()
    assert all(p.requires_grad for p in model.parameters())


def test_the_default_code_follows_a_moment_that_changes_slowly_when_encoded_every_step():
    """compress_all encodes every moment again at every step. The default linear code rounds stochastically
    (unbiased), so a second moment that decays by beta2 while its block's largest entry is held up still
    decays (the dynamic code's nearest rounding would hold it at 1e-4: docs/fidelity.md)."""
    from slimfit.scheduler.config import STATE_CODES

    code, bits = STATE_CODES[SchedulerConfig().state_code]
    v = torch.full((128,), 1e-4)
    for step in range(500):
        v = v * 0.999
        v[0] = 1.0
        v = codec.decode(codec.encode(v, sqrt=True, seed=step, code=code, bits=bits))
    exact = 1e-4 * 0.999 ** 500
    assert abs(float(v[1:].mean()) - exact) < 0.1 * exact
