"""Small host-side helpers shared by the Triton launchers."""
from __future__ import annotations

import contextlib
import struct

import torch


def on_device(t: torch.Tensor):
    """Launch on t's GPU (Triton launches on the *current* device); no-op on CPU tensors
    (the interpreter)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def fp32(v: float) -> float:
    """v rounded to the nearest fp32 (ties to even), as torch casts a Python scalar."""
    try:
        return struct.unpack("f", struct.pack("f", float(v)))[0]
    except OverflowError:  # beyond the fp32 range: torch gives +-inf
        return float("inf") if v > 0 else float("-inf")
