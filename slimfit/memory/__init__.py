"""What a training step costs in memory: measured (saved bytes, the whole step's peak), predicted before the
run (the plan), for the reference models, and the `slimfit memory` / `slimfit plan` commands.

    from slimfit.memory import measure, measure_step
    saved = measure(model, **batch)                  # bytes autograd keeps for backward, per module
    peak = measure_step(model, batch, optimizer)     # the whole step's peak: weights to temporaries
    from slimfit.memory.plan import StepSpec, predict
    predict(StepSpec("bert-base", batch=8, seq=256, preset="paper", rate=0.7)).total   # before the run

The files, leaves first (no module imports one listed after it):
  units.py    format_bytes (every table's byte formatter) and parse_bytes (--fit BUDGET)
  loss.py     training_loss: the loss a measured step runs backward on (one policy: never made up)
  saved.py    measure / saved_bytes / report: bytes saved for backward, per module (saved-tensor hooks)
  peak.py     measure_step / StepMemory: the whole step's peak and its parts (a storage tracker, or CUDA's
              allocator); step_report
  models.py   the reference architectures (names, configs, random batches) and ModelRef, the model a plan
              is about (an architecture, a config, a cached hub id)
  runs.py     one reference step made and measured: the scheduler's first frozen set, a primed AdamW,
              saved_of_step / peak_of_step
  plan/       the step's peak predicted on fake tensors (slimfit/memory/plan/__init__.py lists its files)
  cli.py      `slimfit memory` and `slimfit plan`: one flag vocabulary, one preset list
"""
from __future__ import annotations

from .loss import NoLossError, training_loss
from .peak import PARTS, StepMemory, measure_step
from .peak import report as step_report
from .saved import SavedMemory, measure, report, saved_bytes
from .units import format_bytes, parse_bytes

__all__ = ["SavedMemory", "measure", "report", "saved_bytes", "StepMemory", "measure_step", "step_report", "PARTS",
           "NoLossError", "training_loss", "format_bytes", "parse_bytes"]
