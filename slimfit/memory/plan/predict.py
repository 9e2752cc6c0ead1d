"""The plan's two entry points for a spec's step: predict (fake tensors, nothing allocated) and measure (for
real, the ground truth a prediction is compared with).

    p = predict(StepSpec("bert-base", batch=8, seq=256, preset="paper", rate=0.7))
    p.total, p.parts(), p.peak_phase                    # bytes; what the peak is made of; where it is
    measure(spec).total                                 # the same step run and measured (slimfit.memory.measure_step)

Each computes the scheduler's budget first when the spec asks for its budget mode (budget_bytes: budget.py's
scheduler_budget) and hands it to the step builder (step.py), which does not plan: the modules of the plan
import one way only. fakerun.py runs the fake step; it says why fake tensors and how exact.
"""
from __future__ import annotations

from typing import Callable

from .. import peak
from ..models import ModelRef, resolve_model
from .budget import scheduler_budget
from .fakerun import SCHEDULER_RUN_NUMEL, Prediction, predict_step
from .spec import StepSpec
from .step import Step, open_step, run_step

__all__ = ["Prediction", "predict", "measure", "SCHEDULER_RUN_NUMEL"]


def _budget(spec: StepSpec, ref: ModelRef, freeze_all: bool = False) -> dict | None:
    """The scheduler's budget-mode arguments for a spec with budget_bytes (None without, or all frozen)."""
    if spec.budget_bytes is None or freeze_all:
        return None
    return scheduler_budget(spec.replace(budget_bytes=None), spec.budget_bytes, ref=ref)


def predict(spec: StepSpec, ref: ModelRef | None = None, freeze_all: bool = False) -> Prediction:
    """Predict the whole step's peak memory of `spec` without allocating it (fake tensors). freeze_all: with
    every layer the scheduler would schedule frozen (the base of a budget, budget.py)."""
    ref = ref or resolve_model(spec.model, spec.task)
    return predict_step(spec, ref=ref, freeze_all=freeze_all, budget=_budget(spec, ref, freeze_all))


def measure(spec: StepSpec, warmup_steps: int = 0, ref: ModelRef | None = None,
            on_step: Callable[[Step], None] | None = None) -> peak.StepMemory:
    """The spec's step run for real and measured (slimfit.memory.measure_step): the ground truth a prediction
    is compared with. warmup_steps whole steps run first (CUDA: allocator, cuBLAS)."""
    ref = ref or resolve_model(spec.model, spec.task)
    with open_step(spec, ref=ref, budget=_budget(spec, ref)) as step:
        if on_step is not None:
            on_step(step)
        for _ in range(warmup_steps):
            run_step(step)
        return peak.measure_step(step.model, step.forward, step.optimizer, after_step=step.after_step,
                                 name=spec.label())
