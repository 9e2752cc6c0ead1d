"""optimizer_state="host": every layer's AdamW moments in host memory between steps, streamed to the device a
piece at a time inside the chunked step (under step_in_backward: inside each parameter's own step) and back right
after it. Lossless: the weights match optimizer_state="full" bit for bit (on the CPU the host copy is another
storage, so the logic is what is tested)."""
import pytest
import torch
from _optim_models import build, data, train

from slimfit.optim import step_in_backward
from slimfit.optim.keys import HOST
from slimfit.optim.transfer import CpuTransfer
from slimfit.scheduler import ILSScheduler, SchedulerConfig

STEPS = ("in_backward", "chunked")


def _optimizer(model, step):
    if step == "in_backward":
        return step_in_backward(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _run(optimizer_state, steps=5, record=None, step="in_backward", dtype=torch.float32, **options):
    model = build(0).to(dtype)
    opt = _optimizer(model, step)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, optimizer_state=optimizer_state, seed=3,
                         warmup_steps=0, **options)
    batch = tuple(t.to(dtype) for t in data())
    for _ in range(steps):
        train(model, opt, batch, 1, sched=sched)
        if record is not None:
            record.append({p: dict(opt.state.get(p, {})) for p in sched.params})
    return model, opt, sched


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_state_trains_as_the_state_in_full(step, dtype):
    """Bit for bit, fp32 weights and bf16 ones (written by stochastic rounding from the same seeds)."""
    host, _, _ = _run("host", step=step, dtype=dtype)
    full, _, _ = _run("full", step=step, dtype=dtype)
    moved = 0
    for (name, a), b, c in zip(host.named_parameters(), full.parameters(), build(0).to(dtype).parameters()):
        assert torch.equal(a, b), name
        moved += not torch.equal(a, c)
    assert moved == len(list(full.parameters()))


class _Recording(CpuTransfer):
    """The CPU's transfer, recording the size of every copy to the device (whole or a piece)."""

    def __init__(self):
        self.whole, self.pieces, self.zeros = [], [], []

    def to_device(self, host, device):
        self.whole.append(host.numel())
        return super().to_device(host, device)

    def piece_to_device(self, host, device):
        self.pieces.append(host.numel())
        return super().piece_to_device(host, device)

    def zeros_host(self, shape, dtype):
        self.zeros.append(torch.Size(shape).numel())
        return super().zeros_host(shape, dtype)


@pytest.mark.parametrize("step", STEPS)
def test_moments_reach_the_device_a_piece_at_a_time(step):
    """No parameter's moments come back whole: each step copies pieces of at most step_chunk_numel elements;
    every state is made at the attach as zeros on the host (no device state at the first step)."""
    model = build(0)
    opt = _optimizer(model, step)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, optimizer_state="host", seed=3, warmup_steps=0,
                         step_chunk_numel=1024)
    for p in model.parameters():   # every state made at the attach, zeros on the host
        assert opt.state[p]["exp_avg" + HOST].count_nonzero() == 0 and "exp_avg" not in opt.state[p]
    recording = sched.state_holder._one_transfer = _Recording()
    train(model, opt, data(), 4, sched=sched)
    largest = max(p.numel() for p in model.parameters())
    assert largest > 1024 and recording.pieces and max(recording.pieces) <= 1024
    assert recording.whole == [] and recording.zeros == []
    for p in model.parameters():
        assert not any(isinstance(v, torch.Tensor) and v.numel() > 1 for k, v in opt.state[p].items()
                       if not k.endswith(HOST))


def test_an_optimizer_the_chunked_step_does_not_take_cannot_stream_host_state():
    model = build(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    with pytest.raises(ValueError, match="chunked step.*step_in_backward.*'host-frozen'"):
        ILSScheduler(model, freeze_rate=0.5, optimizer=opt, optimizer_state="host")


@pytest.mark.parametrize("step", STEPS)
def test_every_layers_state_is_on_the_host_between_steps(step):
    states = []
    _, opt, sched = _run("host", steps=3, record=states, step=step)
    for step_states in states:
        for st in step_states.values():
            if st:   # every state held between steps, the trained layers' too
                assert set(st) >= {"exp_avg" + HOST, "exp_avg_sq" + HOST} and "exp_avg" not in st
    assert any(p.requires_grad and opt.state.get(p) for p in sched.params)
    sched.close()   # every state back, as AdamW keeps it
    assert all("exp_avg" in opt.state[p] for p in sched.params if opt.state.get(p))


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
