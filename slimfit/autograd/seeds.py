"""Seeds of the random draws that happen only while a graph is built (stochastic rounding of saved
activations, WTA-CRS row draws), taken without advancing torch's default generator.

Why: reentrant gradient checkpointing runs a segment once under torch.no_grad (no activation is
saved, so none of these draws happens) and again, with the generator's state restored, to build
the graph (they happen). Dropout seeds are drawn from torch's generator in both passes; a draw that
advanced the generator in the recompute only would shift every later dropout seed, and the
gradient would belong to other dropout masks than the loss. So a side seed reads the generator
(draws, then restores its state) and mixes in a tag of the call (op name and shape): the same
state and the same call give the same seed, so `torch.manual_seed` keeps runs repeatable.

Calls with the same tag at the same generator state share a seed (e.g. two same-shaped layers with
no dropout between them): each estimate stays unbiased. A patched model with such draws advances
the generator once per forward (slimfit.patch), so successive steps do not repeat their seeds.
"""
from __future__ import annotations

import zlib

import torch

from ..kernels.rng import lowbias32_int

__all__ = ["side_seed"]


def side_seed(*tag) -> int:
    """A seed in [0, 2**62) from torch's default CPU generator, leaving the generator as it was."""
    gen = torch.default_generator
    state = gen.get_state()
    try:
        base = int(torch.randint(0, 2**62, (1,), dtype=torch.int64, generator=gen).item())
    finally:
        gen.set_state(state)
    h = zlib.crc32(repr(tag).encode())
    mix = (lowbias32_int(h) << 30) ^ lowbias32_int(h ^ 0x9E3779B9)
    return (base ^ mix) & ((1 << 62) - 1)
