"""The Adam/AdamW step of parameters whose moments stay in host memory between steps, a piece at a time.

With ``FrozenState(mode="offload", between_steps=True)`` (``optimizer_state="host"``) every parameter's moments
live in host memory from one step to the next. The ChunkedStep then streams them: for each batch of pieces
(about ``chunk_numel`` elements) it copies the pieces' moments to the device, runs torch's functional Adam on
them (held_step.step_pieces, as the 8-bit moments are stepped) and copies them back into the host buffers. So
the device never holds a whole parameter's moments, only a batch of pieces': Llama-3.1-8B's 128k x 4096 input
embedding has 2 GiB of bf16 moments, which a whole round trip would bring back at once, on top of its 1 GiB
gradient, at the end of backward. A fresh state is made on the host (zeros), never on the device.

Lossless: each element sees torch's arithmetic, bit for bit (tested against the state in full). The copies
run on the compute stream in line with the step (transfer.py's piece_to_device / piece_to_host_): the same
bytes as a whole round trip, without its overlap with backward, and one piece's moments on the device.
"""
from __future__ import annotations

import torch

from .held_step import _new_step, held_moments, step_pieces
from .keys import HOST
from .pieces import factor_runs
from .sharded_params import local
from .torch_adam import lr_factors
from .weight_rounding import ROUNDED_DTYPES

__all__ = ["is_host_held", "new_host_state", "step_host"]


def is_host_held(state, group) -> bool:
    """Every moment of this parameter's state in host memory (and the step count plain)."""
    return "step" in state and all(isinstance(state.get(k + HOST), torch.Tensor) for k, _ in held_moments(group))


def new_host_state(p, group, holder) -> dict:
    """A fresh Adam state for ``p`` with its moments zeros in host memory (torch's zero state, never made on the
    device); an FSDP2 shard's moments are this rank's piece."""
    state = {"step": _new_step(p, group)}
    transfer, shape = holder.transfer(p.device), local(p).shape
    for key, _ in held_moments(group):
        state[key + HOST] = transfer.zeros_host(shape, p.dtype)
    return state


@torch.no_grad()
def step_host(optimizer, group, params, chunk_numel: int, observer, holder, rounding=None) -> None:
    """torch's Adam step of ``params`` (host-held, each with a gradient), a batch of pieces at a time: each
    batch's moments copied to the device, stepped, copied back; gradients dropped. ``rounding`` as in
    held_step.step_held."""
    moments = held_moments(group)
    states = [optimizer.state[p] for p in params]
    if rounding is not None and not any(p.dtype in ROUNDED_DTYPES for p in params):
        rounding = None   # fp32 weights: nothing to round
    pieces_of = [local(p) for p in params]
    transfers = [holder.transfer(p.device) for p in params]
    # cut and packed as the step of moments in full (pieces.py): the same weights, bit for bit
    batches = list(factor_runs(pieces_of, lr_factors(observer, params), chunk_numel))

    def hosts(batch):
        return [[states[i][key + HOST].view(-1)[a:b] for i, a, b in batch] for key, _ in moments]

    def load(batch, numbers, starts):
        return [[transfers[i].piece_to_device(h, pieces_of[i].device) for (i, _, _), h in zip(batch, hs)]
                for hs in hosts(batch)]

    def store(batch, m, numbers, starts):
        for hs, xs in zip(hosts(batch), m):
            for (i, _, _), h, x in zip(batch, hs, xs):
                transfers[i].piece_to_host_(h, x)

    step_pieces(optimizer, group, params, batches, observer, rounding, load, store)
