"""The plan: will this fine-tuning step fit, before the run (`slimfit plan`; also importable as slimfit.plan).

    from slimfit.plan import StepSpec, predict
    p = predict(StepSpec("bert-base", batch=8, seq=256, preset="paper", rate=0.7))
    p.total, p.parts()                                  # the whole step's peak bytes, and what it holds

The files, leaves first (no module imports one listed after it):
  spec.py       StepSpec: the model, the batch and every choice that changes the step's memory
  cost.py       the time model (flops, bytes moved, ops) that ranks configurations
  fake.py       keeps a step on fake tensors on the real step's path (PlanMode)
  optim8bit.py  torchao's AdamW8bit, and its stand-in on fake tensors
  step.py       open_step: the step of a spec, built one way for the prediction and the measurement; it is
                handed the scheduler's budget, never computes it
  fakerun.py    predict_step: the step run on fake tensors under slimfit.memory.measure_step's tracker
  budget.py     scheduler_budget / layer_bytes (ILSScheduler's budget mode), rate_bound (any frozen set's peak)
  predict.py    predict and measure: the budget computed first, then the step (fake, or for real)
  search.py     fit: the fastest configuration under a budget (`--fit`)
  code.py       render: a configuration as code to paste
The model a plan is about is slimfit/memory/models.py's (ModelRef); the command is slimfit/memory/cli.py.
"""
from __future__ import annotations

from ..models import ModelRef, resolve_model
from .budget import layer_bytes, rate_bound, scheduler_budget
from .predict import Prediction, measure, predict
from .spec import StepSpec
from .step import open_step

__all__ = ["StepSpec", "ModelRef", "resolve_model", "Prediction", "predict", "measure", "open_step",
           "scheduler_budget", "layer_bytes", "rate_bound"]
