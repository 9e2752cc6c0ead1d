"""`slimfit.plan`: a training step's peak memory predicted before the run, kept importable under this name.

    from slimfit.plan import StepSpec, predict
    predict(StepSpec("bert-base", batch=8, seq=256, preset="paper", rate=0.7)).total

The code lives in slimfit/memory/plan/ (the memory package: saved bytes, the step peak, the plan); its modules
(step, search, code, ...) are imported from there, e.g. `from slimfit.memory.plan.search import fit`.
"""
from __future__ import annotations

from .memory.plan import (
                          ModelRef,
                          Prediction,
                          StepSpec,
                          layer_bytes,
                          measure,
                          open_step,
                          predict,
                          rate_bound,
                          resolve_model,
                          scheduler_budget,
)

__all__ = ["StepSpec", "ModelRef", "resolve_model", "Prediction", "predict", "measure", "open_step",
           "scheduler_budget", "layer_bytes", "rate_bound"]
