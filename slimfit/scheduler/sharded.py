"""Scores of FSDP2-sharded layers: each rank reduces its own shard, one all-reduce adds them up.

Under ``fully_shard`` every parameter is a DTensor whose rank-local piece is ``to_local()``.
A score is a ratio of sums over all entries (relative: Σ|ΔW/W_old| over the entries with
W_old != 0 and their count; robust: Σ ΔW² and Σ W_old²; absolute: Σ|ΔW| and the entry count),
so each rank computes the partial sums of its shard, one ``all_reduce(SUM)`` of a (layers x 3)
tensor adds them, and every rank finishes the same ratios: the same scores everywhere, no
broadcast needed. Parameters that are not sharded (replicated on every rank) are counted on
the group's first rank only.

Snapshots of sharded layers are kept as local shards: a rank holds 1/world of W_old.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["is_sharded", "local_tensor", "sharded_scores", "process_group_ready"]


def is_sharded(p: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # torch built without distributed
        return False
    return isinstance(p, DTensor)


def process_group_ready() -> bool:
    """torch.distributed initialised (any world size: FSDP2 on one rank makes DTensors too)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The rank-local piece of a DTensor parameter (detached), or the tensor itself."""
    t = p.detach()
    return t.to_local() if is_sharded(t) else t


def _partial_sums(kind: str, old: torch.Tensor, new: torch.Tensor) -> tuple[float, float, float]:
    o, w = old.double().reshape(-1), new.double().reshape(-1)
    d = w - o
    if kind == "robust":
        return float((d * d).sum()), float((o * o).sum()), 0.0
    if kind == "absolute":
        return float(d.abs().sum()), float(d.numel()), 0.0
    keep = o != 0
    return float((d[keep] / o[keep]).abs().sum()), float(keep.sum()), float(d.abs().sum())


def _finish(kind: str, total: float, count: float, moved: float) -> float:
    if kind == "absolute":
        return total / count if count > 0 else 0.0
    if kind == "robust":
        if count > 0:
            return math.sqrt(total) / math.sqrt(count)
        return math.inf if total > 0 else 0.0
    if count > 0:
        return total / count
    return math.inf if moved > 0 else 0.0


@torch.no_grad()
def sharded_scores(kind: str, olds: Sequence, news: Sequence[torch.Tensor], group=None,
                   refresh: bool = False) -> torch.Tensor:
    """Scores (float64, CPU) of layers whose parameters ``news`` are DTensors (or replicated tensors),
    identical on every rank of ``group``. Each of ``olds`` is this rank's part of a layer: its snapshot (a
    local shard), its three partial sums already taken (summed inside a chunked step: scores.BlockSums.sums,
    the same sums as ``_partial_sums``), or None (this rank's shard did not move). ``refresh`` copies the new
    local shards into the snapshots afterwards."""
    import torch.distributed as dist

    first = dist.get_rank(group) == 0
    sums = torch.zeros(len(olds), 3, dtype=torch.float64)
    for i, (old, new) in enumerate(zip(olds, news)):
        if old is None or not (is_sharded(new) or first):
            continue
        part = _partial_sums(kind, old, local_tensor(new)) if isinstance(old, torch.Tensor) else old
        sums[i] = torch.tensor(part, dtype=torch.float64)
    device = news[0].device if dist.get_backend(group) != "gloo" else torch.device("cpu")
    reduced = sums.to(device)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
    reduced = reduced.cpu()
    if refresh:
        for old, new in zip(olds, news):
            if isinstance(old, torch.Tensor):
                old.copy_(local_tensor(new))
    return torch.tensor([_finish(kind, *row.tolist()) for row in reduced], dtype=torch.float64)
