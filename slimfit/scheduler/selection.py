"""Pure selection logic: given scores, pick the layers to train next step.

Everything here works on host-side lists/tensors of length L (the number of candidate
layers) and is deterministic: ties are broken by layer index (model order).

Order of preference for a training slot:
 1. layers never trained yet, by their (large, seeded random) initial score, highest
    first: the first iterations go round-robin over all layers;
 2. the others by priority, highest first. Priority is the score (SlimFit), or with
    ``memory_aware`` the score per activation byte that training the layer costs
    (score / bytes; a layer that costs no activation memory comes first).
The ``n_train = L - n_frozen`` best layers are trained, the rest frozen. A budget
(bytes) additionally leaves out each layer whose activation bytes exceed what the layers taken
before it leave of the budget; such a layer is skipped, not the whole selection. Minimum
trained/frozen durations are soft: they are honoured unless the count or the budget says otherwise.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import torch

__all__ = ["num_frozen", "training_order", "choose_trained", "starved_first"]

ROUNDINGS = ("round", "floor")


def num_frozen(rate: float, n_layers: int, rounding: str = "round") -> int:
    """How many of ``n_layers`` layers a freeze rate freezes.

    ``round`` (default): round(rate * L), halves up; ``floor``: int(rate * L) as in the
    SlimFit code. Never all of them: at least one layer always trains (a schedule with
    every layer frozen would never see a new score again).
    """
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not (0.0 <= rate < 1.0):
        raise ValueError(f"freeze_rate must be in [0, 1) (a number: the fraction of layers frozen), got "
                         f"{type(rate).__name__} {rate!r}")
    if isinstance(n_layers, bool) or not isinstance(n_layers, numbers.Integral) or n_layers < 0:
        raise ValueError(f"n_layers must be an int >= 0 (the number of scheduled layers), got "
                         f"{type(n_layers).__name__} {n_layers!r}")
    if rounding == "round":
        k = math.floor(rate * n_layers + 0.5)
    elif rounding == "floor":
        k = math.floor(rate * n_layers)
    else:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    return max(0, min(k, n_layers - 1))


def training_order(scores: torch.Tensor, seen: torch.Tensor,
                   bytes_: Optional[torch.Tensor] = None, memory_aware: bool = False) -> list[int]:
    """Layer indices, best candidate for training first."""
    scores = scores.to(torch.float64)
    # NaN means "unknown": treat as +inf (keep training), like argsort in the paper's code.
    scores = torch.where(torch.isnan(scores), torch.full_like(scores, math.inf), scores)
    prio = scores
    if memory_aware:
        if bytes_ is None:
            raise ValueError("memory_aware selection needs activation byte estimates")
        b = bytes_.to(torch.float64)
        prio = torch.where(b > 0, scores / b.clamp_min(1.0), torch.full_like(scores, math.inf))
    n = scores.numel()
    idx = torch.arange(n)
    unseen = ~seen
    # Stable sorts on a descending key keep index order within ties.
    order_unseen = idx[unseen][torch.argsort(-scores[unseen], stable=True)]
    seen_idx = idx[seen]
    # Among seen layers: by priority, then by score (breaks ties of infinite priority).
    sub = seen_idx[torch.argsort(-scores[seen_idx], stable=True)]
    sub = sub[torch.argsort(-prio[sub], stable=True)]
    return order_unseen.tolist() + sub.tolist()


def choose_trained(order: Sequence[int], n_train: int, *,
                   bytes_: Optional[Sequence[float]] = None,
                   budget: Optional[float] = None,
                   must_train: Sequence[bool] = (),
                   must_freeze: Sequence[bool] = ()) -> list[int]:
    """Pick up to ``n_train`` layers following ``order``.

    ``bytes_``/``budget``: a layer is added only while the sum of bytes of the chosen
    layers stays <= budget. ``must_train``/``must_freeze`` (per layer, may be empty):
    soft minimum-duration constraints — must_train layers are taken first, must_freeze
    layers last.
    """
    chosen: list[int] = []
    taken: set[int] = set()
    used = 0.0

    def try_add(i: int) -> None:
        nonlocal used
        if len(chosen) >= n_train or i in taken:
            return
        if budget is not None:
            b = float(bytes_[i])
            if used + b > budget:
                return
            used += b
        chosen.append(i)
        taken.add(i)

    mt = list(must_train) if len(must_train) else None
    mf = list(must_freeze) if len(must_freeze) else None
    if mt is not None:
        for i in order:
            if mt[i]:
                try_add(i)
    for i in order:
        if mf is None or not mf[i]:
            try_add(i)
    if mf is not None:
        for i in order:
            try_add(i)
    return sorted(chosen)


def starved_first(order: Sequence[int], train_count: torch.Tensor, steps: int,
                  min_share: float) -> tuple[list[int], list[bool]]:
    """``order`` with the layers that trained in less than ``min_share`` of ``steps`` moved to
    the front, the most starved (lowest share) first, and a per-layer flag of those layers.
    The flag goes to ``choose_trained`` as ``must_train``."""
    need = min_share * (steps + 1)  # by the end of the coming step
    counts = train_count.tolist()
    starved = [c < need - 1e-9 for c in counts]
    if not any(starved):
        return list(order), [False] * len(counts)
    rank = {i: r for r, i in enumerate(order)}
    front = sorted((i for i in order if starved[i]), key=lambda i: (counts[i], rank[i]))
    rest = [i for i in order if not starved[i]]
    return front + rest, starved
