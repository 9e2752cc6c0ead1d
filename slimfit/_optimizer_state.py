"""The optimizer state's vocabulary, shared by the scheduler, slimfit.optim and the planner: the names of the
ways AdamW's moments can be held, the one rule that resolves "auto", the chunk size of the chunked step, the
codes of a held moment, and unwrapping an optimizer wrapper.

Pure Python over torch (no kernel, no other slimfit module), so that slimfit.scheduler imports it at the top
and stays below slimfit.optim, which holds the moments (FrozenState) and takes the step (ChunkedStep) and is
imported by the scheduler only when an optimizer is attached (slimfit/optim/attach.py). It sits beside
_config_base.py rather than in slimfit/optim/ because importing any module of that package runs its
``__init__``, which loads the kernels.

``SchedulerConfig.optimizer_state`` (``ILSScheduler(..., optimizer_state=...)``, ``StepSpec.optimizer_state``,
``slimfit plan --optimizer-state``) names what is held:

  "auto"         the default: "8bit" where the optimizer's step can hold every state (a torch Adam/AdamW under
                 the chunked step, or step_in_backward), else "8bit-frozen"; nothing held under the
                 experimental frozen_update="momentum" (it steps frozen layers with their moments), nor for an
                 optimizer whose state is not plain tensors (torchao's AdamW8bit, in the planner)
  "8bit"         every layer's moments 8-bit, the trained ones too (decoded, updated and encoded a piece at a
                 time inside the step); an error where the step cannot hold them
  "8bit-frozen"  the frozen layers' moments 8-bit while they are frozen
  "host-frozen"  the frozen layers' moments in host memory while they are frozen (lossless)
  "host"         every layer's moments in host memory, the trained ones too: streamed to the device a piece at a
                 time inside the chunked step (or each parameter's own step in backward) and back right after
                 (lossless; optim/host_step.py): a piece's moments on the device, never a whole parameter's
  "full"         the state as the optimizer made it

The older name ``frozen_state`` is read everywhere (keyword, saved configs, the planner, ``--frozen-state``):
its values "auto", "compress_all", "compress", "offload" and None are FROZEN_STATE_NAMES' keys ("offload_all",
"host"'s, names it in that vocabulary, which the planner and ``frozen_state_mode`` report in).
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["OPTIMIZER_STATES", "DEFAULT_OPTIMIZER_STATE", "FROZEN_STATE_NAMES", "FROZEN_STATES", "STEP_KINDS",
           "HOLDERS", "STATE_CODES", "NEAREST_STATE_CODES", "DEFAULT_STEP_CHUNK_NUMEL", "AUTO_STEP_CHUNK",
           "auto_step_chunk_numel", "resolve_step_chunk_numel", "from_frozen_state",
           "to_frozen_state", "resolve_state_mode", "holds_any", "unwrap_optimizer"]

OPTIMIZER_STATES = ("auto", "8bit", "8bit-frozen", "host-frozen", "host", "full")
DEFAULT_OPTIMIZER_STATE = "auto"
# frozen_state's values -> optimizer_state's
FROZEN_STATE_NAMES = {"auto": "auto", "compress_all": "8bit", "compress": "8bit-frozen", "offload": "host-frozen",
                      "offload_all": "host", None: "full"}
FROZEN_STATES = tuple(FROZEN_STATE_NAMES)
_TO_FROZEN_STATE = {new: old for old, new in FROZEN_STATE_NAMES.items()}
# What the optimizer's step can hold, the one fact "auto" depends on:
#   "every"   every state (a torch Adam/AdamW under the chunked step, or step_in_backward)
#   "frozen"  the frozen layers' only (another torch optimizer: its state is held while a layer is frozen)
#   "none"    none (an optimizer whose state is not plain tensors, such as torchao's AdamW8bit)
STEP_KINDS = ("every", "frozen", "none")
# A resolved mode -> FrozenState's (mode, between_steps)
HOLDERS = {"8bit": ("compress", True), "8bit-frozen": ("compress", False), "host-frozen": ("offload", False),
           "host": ("offload", True)}
# SchedulerConfig.state_code -> (codec code, bits) of a held moment: "dynamic8" (the default) / "dynamic4"
# (block-wise dynamic codes: signed map for a first moment, sqrt(v) on a zero-free map for a second),
# stochastic rounding; "linear8" (per-group min/max, stochastic rounding); "dynamic8-nearest" /
# "dynamic4-nearest" the same dynamic codes rounded to nearest (NEAREST_STATE_CODES), which hold a moment that
# changes by less than half a level per step.
STATE_CODES = {"linear8": ("linear", 8), "dynamic8": ("dynamic", 8), "dynamic4": ("dynamic", 4),
               "dynamic8-nearest": ("dynamic", 8), "dynamic4-nearest": ("dynamic", 4)}
NEAREST_STATE_CODES = frozenset({"dynamic8-nearest", "dynamic4-nearest"})
# SchedulerConfig.step_chunk_numel: elements per call of the chunked optimizer step (slimfit.optim.ChunkedStep).
# "auto" (the default) is DEFAULT_STEP_CHUNK_NUMEL on the CPU: 2**20 is 4 MiB per fp32 temporary and a multiple
# of the score's block. On a GPU a call is a few dozen kernel launches whatever its size, so a 1M-element call
# of a large model is bound by launching: there a call takes the optimizer's parameters' numel / 256 (a power
# of two, between 2**20 and 2**24), so the step's temporaries stay about 1/256 of the parameters (some 24
# bytes an element of a call: under 5% of bf16 weights) while a billion-parameter model steps in a few
# hundred calls, not a few thousand.
DEFAULT_STEP_CHUNK_NUMEL = 1 << 20
MAX_STEP_CHUNK_NUMEL = 1 << 24
STEP_CHUNK_SHARE = 256
AUTO_STEP_CHUNK = "auto"


def auto_step_chunk_numel(device_type: str, numel: int) -> int:
    """The "auto" step chunk for parameters of ``numel`` elements in all on a ``device_type`` device."""
    if device_type == "cpu":
        return DEFAULT_STEP_CHUNK_NUMEL
    want = max(1, int(numel) // STEP_CHUNK_SHARE)
    return min(MAX_STEP_CHUNK_NUMEL, max(DEFAULT_STEP_CHUNK_NUMEL, 1 << (want - 1).bit_length()))


def resolve_step_chunk_numel(value, params) -> Optional[int]:
    """``value`` (SchedulerConfig.step_chunk_numel) for an optimizer of ``params``: an int or None as it is;
    "auto" by their device (the first's) and their numel (auto_step_chunk_numel)."""
    if not (isinstance(value, str) and value == AUTO_STEP_CHUNK):
        return value
    params = list(params)
    device_type = params[0].device.type if params else "cpu"
    return auto_step_chunk_numel(device_type, sum(p.numel() for p in params))


def from_frozen_state(value) -> str:
    """optimizer_state's name of a frozen_state value (ValueError for a value frozen_state never had)."""
    if not (value is None or isinstance(value, str)) or value not in FROZEN_STATE_NAMES:
        raise ValueError(f"frozen_state must be one of {FROZEN_STATES}, got {value!r}")
    return FROZEN_STATE_NAMES[value]


def to_frozen_state(mode) -> Optional[str]:
    """frozen_state's name of an optimizer_state value or of a resolved mode (None: "full", or nothing held)."""
    return None if mode is None else _TO_FROZEN_STATE[_canonical(mode)]


def _canonical(mode) -> str:
    """optimizer_state's name of a value given in either vocabulary (None is frozen_state's "full")."""
    if isinstance(mode, str) and mode in OPTIMIZER_STATES:
        return mode
    return from_frozen_state(mode)


def resolve_state_mode(mode, step: str = "every", momentum: bool = False) -> Optional[str]:
    """What ``mode`` (an optimizer_state or a frozen_state value) holds with an optimizer whose step can hold
    ``step`` (STEP_KINDS) and the experimental frozen_update="momentum" on or off: "8bit", "8bit-frozen",
    "host-frozen", or None (nothing held). Only "auto" depends on them; a named mode is returned as it is, for
    its holder to refuse an optimizer that cannot hold it. The scheduler, slimfit.optim and the planner all
    call this, so they agree on what the default holds."""
    if step not in STEP_KINDS:
        raise ValueError(f"resolve_state_mode: step must be one of {STEP_KINDS}, got {step!r}")
    mode = _canonical(mode)
    if mode == "full":
        return None
    if mode != "auto":
        return mode
    if momentum or step == "none":
        return None
    return "8bit" if step == "every" else "8bit-frozen"


def holds_any(mode, momentum: bool = False) -> bool:
    """Whether ``mode`` can hold some state with some optimizer (so an attached optimizer needs slimfit.optim)."""
    return resolve_state_mode(mode, "every", momentum) is not None


def unwrap_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside wrappers such as accelerate's AcceleratedOptimizer (``.optimizer``), where
    hooks and held state belong; TypeError for anything else."""
    opt = optimizer
    for _ in range(8):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not opt:
            opt = inner
        else:
            break
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError("optimizer: expected a torch.optim.Optimizer (or a wrapper with .optimizer, such as "
                        "accelerate's AcceleratedOptimizer), "
                        f"got {type(optimizer).__name__}")
    return opt
