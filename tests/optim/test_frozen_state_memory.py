"""What held frozen state saves, measured by slimfit.step_memory.measure_step against the format's formula."""
import pytest
import torch
from _optim_models import build, data, frozen_params, loss_of, train

from slimfit.optim import attach_frozen_state, encoded_nbytes
from slimfit.scheduler import ILSScheduler
from slimfit.step_memory import measure_step


def _measured(mode):
    """One measured step after 4 (every layer has state by then: the scheduler's round robin at rate 0.5).
    lr=0: the moments evolve but no weight moves, so every score is 0 and the scheduler picks the same frozen
    sets with and without compressed state (which changes the weights' path, hence the scores)."""
    model = build(0, d=256, depth=4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, frozen_state=None, warmup_steps=0)
    frozen_state = attach_frozen_state(sched, opt, mode=mode, code="linear") if mode else None
    batch = data()
    train(model, opt, batch, 4, sched=sched)
    frozen = [p for p in frozen_params(sched) if p in opt.state]
    run = measure_step(model, lambda: loss_of(model, batch), opt)
    return run, frozen, frozen_state, opt   # FrozenState holds its optimizer weakly: the caller keeps it


def test_compressed_frozen_state_saves_what_the_format_says():
    plain, frozen, _, _ = _measured(None)
    comp, frozen_c, frozen_state, _opt = _measured("compress")
    assert [p.shape for p in frozen] == [p.shape for p in frozen_c] and frozen
    full = sum(8 * p.numel() for p in frozen)                          # exp_avg + exp_avg_sq, fp32
    held = sum(2 * encoded_nbytes(p.numel()) for p in frozen)
    assert frozen_state.held_nbytes() == held
    assert full / held == pytest.approx(8 / (2 * (1 + 8 / 128)), rel=0.01)   # 3.76x at group 128
    assert plain.optimizer_state - comp.optimizer_state == full - held
    assert plain.total - comp.total == full - held                    # the whole step's peak, byte for byte
    assert plain.peak_phase == comp.peak_phase == "optimizer"


def test_offload_on_the_cpu_saves_nothing():
    """On a CPU-only machine the "host" copy lives in the same memory: the optimizer state is as large."""
    plain, _, _, _ = _measured(None)
    off, frozen, frozen_state, _opt = _measured("offload")
    assert frozen_state.held_nbytes() == sum(8 * p.numel() for p in frozen)
    assert off.optimizer_state == plain.optimizer_state and off.total == plain.total
