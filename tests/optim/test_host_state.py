"""optimizer_state="host": every layer's AdamW moments in host memory between steps, each parameter's copied to the
device for its own step inside backward (step_in_backward) and back right after it. Lossless: the weights match
optimizer_state="full" bit for bit (on the CPU the host copy is another storage, so the logic is what is tested)."""
import pytest
import torch
from _optim_models import build, data, train

from slimfit.optim import step_in_backward
from slimfit.optim.keys import HOST
from slimfit.scheduler import ILSScheduler, SchedulerConfig


def _run(optimizer_state, steps=5, record=None):
    model = build(0)
    opt = step_in_backward(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, optimizer_state=optimizer_state, seed=3,
                         warmup_steps=0)
    for _ in range(steps):
        train(model, opt, data(), 1, sched=sched)
        if record is not None:
            record.append({p: dict(opt.state.get(p, {})) for p in sched.params})
    return model, opt, sched


def test_host_state_trains_as_the_state_in_full():
    host, _, _ = _run("host")
    full, _, _ = _run("full")
    for (name, a), b in zip(host.named_parameters(), full.parameters()):
        assert torch.equal(a, b), name


def test_every_layers_state_is_on_the_host_between_steps():
    states = []
    _, opt, sched = _run("host", steps=3, record=states)
    for step_states in states:
        for st in step_states.values():
            if st:   # every state held between steps, the trained layers' too
                assert set(st) >= {"exp_avg" + HOST, "exp_avg_sq" + HOST} and "exp_avg" not in st
    assert any(p.requires_grad and opt.state.get(p) for p in sched.params)
    sched.close()   # every state back, as AdamW keeps it
    assert all("exp_avg" in opt.state[p] for p in sched.params if opt.state.get(p))


def test_host_state_needs_the_step_in_backward():
    model = build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="step_in_backward.*'host-frozen'"):
        ILSScheduler(model, freeze_rate=0.5, optimizer=opt, optimizer_state="host")


def test_host_state_names():
    config = SchedulerConfig(optimizer_state="host")
    assert config.frozen_state == "offload_all" and config.frozen_state_mode == "offload_all"
    assert SchedulerConfig(frozen_state="offload_all").optimizer_state == "host"
    assert SchedulerConfig.from_dict(config.to_dict()).optimizer_state == "host"


def test_state_made_before_the_attach_is_held_too():
    """A resume (or the planner's primed state): every parameter's state goes to the host at the attach, the
    embeddings, norms and head the scheduler does not schedule included."""
    model = build(0)
    opt = step_in_backward(model, torch.optim.AdamW, lr=1e-2)
    train(model, opt, data(), 1, schedule=None)   # every parameter has state, in full
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, optimizer_state="host")
    unscheduled = [p for p in model.parameters() if all(p is not q for q in sched.params)]
    assert unscheduled
    for p in model.parameters():
        assert "exp_avg" + HOST in opt.state[p] and "exp_avg" not in opt.state[p]
