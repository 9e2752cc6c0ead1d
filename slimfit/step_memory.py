"""`slimfit.step_memory`: the whole training step's peak memory, kept importable under this name.

The code lives in slimfit/memory/peak.py (the memory package: saved bytes, the step peak, the plan);
`slimfit.memory.measure_step` is the same function.
"""
from __future__ import annotations

from .memory.peak import PARTS, StepMemory, measure_step, report

__all__ = ["StepMemory", "measure_step", "report", "PARTS"]
