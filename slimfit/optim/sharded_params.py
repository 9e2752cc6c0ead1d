"""FSDP2's sharded parameters (DTensors) stepped and held on their rank-local pieces.

Under ``fully_shard`` a parameter, its gradient and the Adam moments torch makes for it are DTensors with
the same placements; each rank holds one piece of each (``to_local()``: a plain tensor on the parameter's
storage, so an in-place update of it is the update of the parameter). Adam is elementwise, so a rank steps
its pieces alone, exactly as torch's own step does on DTensors: the chunked step (chunked_step.py) and the
held moments (held_step.py, frozen_state.py) work on the local pieces, and a held moment's entry codes the
rank's piece of it.

A held entry codes blocks of ``group_size`` consecutive elements from its piece's first one. Where every rank's
piece starts at a multiple of the block in the whole parameter (``blocks_fixed``: FSDP2's dim-0 shards of a
weight whose rows hold a multiple of 128 elements, as in every linear layer of BERT, Llama and Qwen), those
blocks are the whole parameter's, whatever the world size: the moments decode to the same values at any
world size, and a checkpoint resharded by torch.distributed.checkpoint holds again to the same codes. A
parameter whose pieces would cut a block (a norm weight or a bias split into pieces of under 128, rows of
576 at an odd row count) keeps its moments in full under sharding: a few bytes, and nothing that depends on
the world size.

``global_start`` places a rank's piece in the parameter's flat index space (FSDP2 shards dim 0, so a piece
is a run of whole rows): the rounding seeds of a piece are drawn from its global position, not from its
local one, so two ranks never round their pieces with the same stream.
"""
from __future__ import annotations

import torch

from slimfit.scheduler.sharded import is_sharded as is_dtensor  # the one DTensor check (the scheduler's)

__all__ = ["is_dtensor", "local", "steppable", "global_start", "like_param", "blocks_fixed"]


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local piece of a DTensor (a plain tensor on its storage, without autograd history), or ``t``."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()


def _partial(placements) -> bool:
    return any(pl.is_partial() for pl in placements)


def steppable(p: torch.Tensor) -> bool:
    """Whether the sharded parameter ``p`` can be stepped on its local pieces: its gradient a DTensor of the
    same mesh and placements (reduced already: no partial sum left) and neither of them partial."""
    g = p.grad
    return (is_dtensor(p) and is_dtensor(g) and g.device_mesh == p.device_mesh and g.placements == p.placements
            and not _partial(p.placements))


def global_start(p: torch.Tensor) -> int:
    """Where this rank's piece of ``p`` starts in ``p``'s flattened global index space (0: not a DTensor, or
    replicated). Exact when only dim 0 is sharded (FSDP2's default); else the rank's first local element's
    global offset, which still tells the ranks' pieces apart."""
    if not is_dtensor(p):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    start, stride = 0, 1
    for size, at in zip(reversed(tuple(p.shape)), reversed(tuple(offset))):
        start += int(at) * stride
        stride *= int(size)
    return start


def like_param(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``x`` (a rank-local piece shaped like ``p``'s) as a DTensor placed as ``p`` is; ``x`` itself when ``p``
    is a plain tensor."""
    if not is_dtensor(p):
        return x
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(x, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _shard_size(p) -> int | None:
    """The number of pieces dim 0 of ``p`` is cut into (1: replicated), or None for any other placement (a
    shard of another dim, two sharded mesh dims)."""
    from torch.distributed.tensor import Replicate, Shard

    sizes = []
    for dim, pl in enumerate(p.placements):
        if isinstance(pl, Shard) and pl.dim == 0:
            sizes.append(p.device_mesh.size(dim))
        elif not isinstance(pl, Replicate):
            return None
    if len(sizes) > 1:
        return None
    return sizes[0] if sizes else 1


def blocks_fixed(p: torch.Tensor, group_size: int) -> bool:
    """Whether every rank's piece of ``p`` starts at a multiple of ``group_size`` in ``p``'s flat index space
    (always for a plain tensor): then its held entries' blocks are the whole parameter's (module docstring)."""
    if not is_dtensor(p):
        return True
    world = _shard_size(p)
    if world is None or p.dim() == 0:
        return False
    rows = int(p.shape[0])
    row = p.numel() // rows if rows else 0
    chunk = -(-rows // world)   # torch.chunk's piece, as FSDP2 cuts dim 0
    return all((min(r * chunk, rows) * row) % group_size == 0 for r in range(world))
