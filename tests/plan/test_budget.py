"""slimfit.plan.scheduler_budget drives ILSScheduler's budget mode: its names are the scheduler's, and the step
it schedules keeps within the budget when measured."""
from __future__ import annotations

import pytest

from slimfit import architectures as archs
from slimfit.plan import StepSpec, measure, predict, scheduler_budget
from slimfit.scheduler import ILSScheduler

SPEC = StepSpec("bert-tiny", batch=2, seq=32, preset="paper", rate=0.5)


def test_the_bytes_name_the_scheduled_layers_of_the_real_model():
    budget = scheduler_budget(SPEC, 10 * 2**20)
    model = archs.build("bert-tiny")
    scheduler = ILSScheduler(model, freeze_rate=0.5, **budget)
    assert set(budget["activation_bytes"]) == set(scheduler.names)
    assert budget["base_bytes"] == predict(SPEC, freeze_all=True).total
    assert all(v > 0 for v in budget["activation_bytes"].values())


@pytest.mark.parametrize("extra", [150_000, 400_000])
def test_a_budget_mode_step_fits_when_measured(extra):
    base = scheduler_budget(SPEC, 1)["base_bytes"]
    spec = SPEC.replace(budget_bytes=base + extra)
    measured = measure(spec)
    assert measured.total <= spec.budget_bytes
    assert predict(spec).total == measured.total


def test_no_scheduler_no_budget():
    with pytest.raises(ValueError, match="no freeze rate"):
        scheduler_budget(SPEC.replace(rate=0.0), 2**30)


def test_the_rate_bound_holds_for_the_frozen_sets_of_later_steps():
    """A rate step's peak moves with its trained set: measured over steps whose sets change, each is at most
    rate_bound (and the first at least the first step's prediction, which the bound must not undercut)."""
    from slimfit import step_memory
    from slimfit.plan import open_step, rate_bound

    bound = rate_bound(SPEC)
    assert bound >= predict(SPEC).total
    peaks, sets = [], set()
    with open_step(SPEC) as step:
        for _ in range(6):
            sets.add(tuple(step.scheduler.frozen_names()))
            run = step_memory.measure_step(step.model, step.forward, step.optimizer, after_step=step.after_step)
            peaks.append(run.total)
    assert len(sets) > 1
    assert max(peaks) <= bound, (peaks, bound)


def test_no_scheduler_no_rate_bound():
    from slimfit.plan import rate_bound

    with pytest.raises(ValueError, match="no freeze rate"):
        rate_bound(SPEC.replace(rate=0.0))
