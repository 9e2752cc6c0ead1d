"""With an optimizer attached and its step its own (step_chunk_numel=None: the chunked step scores without
snapshots, test_in_step_scores.py), the scheduler's weight snapshots are taken right before the weights move
and dropped by its step: none is alive through forward and backward. Scores and frozen sets are those of a
scheduler that snapshots at every step(), with a plain optimizer and with the optimizer step in backward."""
import torch
from _models import MLP, regression_data
from torch import nn

from slimfit.optim import step_in_backward
from slimfit.scheduler import ILSScheduler
from slimfit.step_memory import measure_step

STEPS = 8


def _loss(model, step):
    x, y = regression_data(seed=step % 3)
    return nn.functional.mse_loss(model(x), y)


def _run(attach: bool, in_backward: bool = False, steps: int = STEPS):
    """Scores and frozen sets after each step; snapshots alive at three moments of each step."""
    torch.manual_seed(0)
    model = MLP()
    if in_backward:
        opt = step_in_backward(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # frozen_state=None: the default holds a frozen layer's AdamW state 8-bit, which only an attached
    # optimizer gets (its trajectory would differ for that reason alone)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt if attach else None, seed=0, frozen_state=None,
                         step_chunk_numel=None, warmup_steps=0)
    history, alive = [], []
    for step in range(steps):
        loss = _loss(model, step)
        alive.append(("forward", len(sched._snap)))
        loss.backward()
        alive.append(("backward", len(sched._snap)))
        opt.step()
        alive.append(("optimizer", len(sched._snap)))
        opt.zero_grad(set_to_none=True)
        sched.step()
        history.append((sched._scores.clone(), tuple(sched.frozen_names())))
    return history, alive, sched


def _same(a, b):
    return all(torch.equal(sa, sb) and fa == fb for (sa, fa), (sb, fb) in zip(a, b))


def test_scores_and_frozen_sets_equal_those_of_snapshots_at_every_step():
    eager, eager_alive, eager_sched = _run(attach=False)
    lazy, lazy_alive, lazy_sched = _run(attach=True)
    assert not eager_sched.snapshots_on_update and lazy_sched.snapshots_on_update
    assert _same(eager, lazy)
    trained = len(lazy_sched.trained_names())
    assert all(n > 0 for _, n in eager_alive)                               # kept through every phase
    assert all(n == 0 for phase, n in lazy_alive if phase != "optimizer")   # none in forward and backward
    assert all(n == trained for phase, n in lazy_alive if phase == "optimizer")


def test_with_the_optimizer_step_in_backward_each_layer_is_snapshotted_before_its_own_step():
    eager, _, _ = _run(attach=False)
    lazy, alive, sched = _run(attach=True, in_backward=True)
    assert _same(eager, lazy)     # the in-backward trajectory is the plain loop's (tests/optim)
    assert all(n == 0 for phase, n in alive if phase == "forward")
    assert any(n > 0 for phase, n in alive if phase == "backward")   # taken during backward, as layers step


class _OneUnused(nn.Module):
    """Two scheduled linears; forward uses the first only, so the second trains without a gradient."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x):
        return self.used(x)


def test_a_trained_layer_that_does_not_move_scores_zero():
    torch.manual_seed(0)
    model = _OneUnused()
    opt = step_in_backward(model, torch.optim.AdamW, lr=1e-2)
    sched = ILSScheduler(model, freeze_rate=0.0, optimizer=opt, seed=0, frozen_state=None,
                         step_chunk_numel=None)
    x, y = regression_data(seed=0)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert len(sched._snap) == 1     # the used layer, before its step; the unused one never stepped
    sched.step()
    scores = dict(zip(sched.names, sched._scores.tolist()))
    assert scores["unused.weight"] == 0.0 and scores["used.weight"] > 0.0


def test_the_step_peak_no_longer_holds_the_snapshots():
    """At the step's entry the trained layers' snapshots are gone: the entry (and every phase before the
    optimizer's) is lower by their bytes."""
    def entry(attach: bool) -> tuple[int, int]:
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt if attach else None, seed=0,
                             frozen_state=None, step_chunk_numel=None, warmup_steps=0)
        for step in range(2):
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        trained_bytes = sum(p.numel() * p.element_size() for p in sched.params if p.requires_grad)
        x, y = regression_data(seed=0)
        run = measure_step(model, lambda: nn.functional.mse_loss(model(x), y), opt, loss_fn=lambda out: out,
                           after_step=sched.step)
        return run.resident, trained_bytes

    (eager, trained), (lazy, _) = entry(False), entry(True)
    assert eager - lazy == trained


def test_detaching_the_optimizer_goes_back_to_snapshots_at_every_step():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, seed=0, frozen_state=None,
                         step_chunk_numel=None, warmup_steps=0)
    _loss(model, 0).backward()
    opt.step()
    sched.step()                      # snapshots dropped
    sched._guard.remove()             # as bench/scheduler_overhead.py does to time step() back to back
    sched._guard = None
    assert not sched.snapshots_on_update
    for _ in range(3):
        sched.step()                  # the first finds no snapshot (no score); the next ones have them
    assert len(sched._snap) == len(sched.trained_names())
