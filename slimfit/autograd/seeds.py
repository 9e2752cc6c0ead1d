"""Seeds of the random draws that happen only while a graph is built (stochastic rounding of saved
activations, WTA-CRS row draws), taken without advancing torch's default generator.

Why: reentrant gradient checkpointing runs a segment once under torch.no_grad (no activation is
saved, so none of these draws happens) and again, with the generator's state restored, to build
the graph (they happen). Dropout seeds are drawn from torch's generator in both passes; a draw that
advanced the generator in the recompute only would shift every later dropout seed, and the
gradient would belong to other dropout masks than the loss. So a side seed reads the generator
(draws, then restores its state) and mixes in a count of side seeds drawn at that state, so that
calls at one generator state still get different seeds (stochastic rounding must not repeat its
noise).

Repeatability: the count restarts at `reset_side_seeds()`, which a patched model's root forward
calls (slimfit.patch), after advancing torch's generator by one draw: `torch.manual_seed(s)` then
the same steps give the same seeds. Functions called directly (no patched model) get the same
seeds after `torch.manual_seed(s); reset_side_seeds()`, or in a fresh process.
"""
from __future__ import annotations

import torch

from ..kernels.rng import lowbias32_int

__all__ = ["side_seed", "reset_side_seeds"]

# Side seeds drawn at the current generator state (process-wide, like torch's generator): the count
# restarts whenever the state has moved (a dropout seed was drawn), so a checkpoint's recompute,
# replaying a segment from its restored state, draws the side seeds of the first run.
_count = {"state": None, "n": 0}


def reset_side_seeds() -> None:
    """Restart the count of side seeds (patched models do it at each forward)."""
    _count["state"], _count["n"] = None, 0


def side_seed(*_tag) -> int:
    """A seed in [0, 2**62) from torch's default CPU generator and the side-seed count, leaving the
    generator as it was."""
    gen = torch.default_generator
    state = gen.get_state()
    try:
        base = int(torch.randint(0, 2**62, (1,), dtype=torch.int64, generator=gen).item())
    finally:
        gen.set_state(state)
    if _count["state"] != base:
        _count["state"], _count["n"] = base, 0
    n = _count["n"]
    _count["n"] = n + 1
    mix = (lowbias32_int(n ^ 0x68E31DA4) << 30) ^ lowbias32_int(n ^ 0x9E3779B9)
    return (base ^ mix) & ((1 << 62) - 1)
