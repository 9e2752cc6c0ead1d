"""`slimfit.architectures`: the reference architectures and the one-step helpers that build, freeze and measure
them, kept importable under this name for scripts and notebooks.

The code lives in the memory package: slimfit/memory/models.py (the architectures, their random batches) and
slimfit/memory/runs.py (the frozen set, a primed AdamW, the measured step). Here `measure_step` is
runs.saved_of_step (slimfit.memory.measure of one forward + backward: a SavedMemory) and `measure_step_peak`
is runs.peak_of_step (slimfit.memory.measure_step of one whole step: a StepMemory).
"""
from __future__ import annotations

from .memory.models import (
                            ARCHITECTURES,
                            CAUSAL_LM,
                            IMAGE_CLS,
                            TEXT_CLS,
                            Architecture,
                            build,
                            known_names,
                            make_inputs,
                            max_tokens,
                            resolve,
)
from .memory.runs import (
                            adamw,
                            autocast_context,
                            collapse_layers,
                            collapse_layers_name,
                            prime_optimizer,
                            scheduler_frozen_set,
                            set_frozen,
)
from .memory.runs import peak_of_step as measure_step_peak
from .memory.runs import saved_of_step as measure_step

__all__ = ["ARCHITECTURES", "Architecture", "TEXT_CLS", "CAUSAL_LM", "IMAGE_CLS", "known_names", "resolve", "build",
           "max_tokens", "make_inputs", "scheduler_frozen_set", "set_frozen", "autocast_context", "measure_step",
           "adamw", "prime_optimizer", "measure_step_peak", "collapse_layers", "collapse_layers_name"]
