"""`slimfit plan`: will this fine-tuning step fit, before the run.

    from slimfit.plan import StepSpec, predict
    p = predict(StepSpec("bert-base", batch=8, seq=256, preset="paper", rate=0.7))
    p.total, p.parts()                                  # the whole step's peak bytes, and what it holds

predict.py runs the step on fake tensors under slimfit.step_memory's tracker (docs/plan.md says why and how
exact); step.py builds the step, the same for the prediction and the measurement; search.py finds the fastest
configuration under a budget (cost.py: the time model) and code.py prints it as code to paste; budget.py
gives ILSScheduler(budget_bytes=...) the per-layer bytes, and rate_bound the most any frozen set at a rate can
take; cli.py is the command.
"""
from __future__ import annotations

from .budget import layer_bytes, rate_bound, scheduler_budget
from .models import ModelRef, resolve_model
from .predict import Prediction, predict
from .spec import StepSpec
from .step import measure, open_step

__all__ = ["StepSpec", "ModelRef", "resolve_model", "Prediction", "predict", "measure", "open_step",
           "scheduler_budget", "layer_bytes", "rate_bound"]
