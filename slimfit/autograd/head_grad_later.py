"""A tied head's weight gradient made at the end of backward instead of at its start.

The chunked LM loss (linear_cross_entropy.py) is the first node of backward, and a 16-bit head's weight gradient
is made a block of vocabulary rows at a time, from the saved rows and their logsumexp. A tied head's parameter is
also the input embedding, whose gradient arrives last (sparse_embedding.tied_uses adds the two): made at the loss,
that vocabulary-sized gradient (Qwen2.5-0.5B in bf16: 260 MiB; Llama-3.2-1B: 501 MiB) would sit through the
whole backward of every layer, on top of its activations. With a ``HeadGradLater`` on the head's alias the loss
keeps what the gradient is made from (its saved rows: tokens x hidden, a few MiB) and ``tied_uses`` makes the
gradient when the embedding's arrives: the same function of the same tensors, so the same bits, only later.

Taken where it costs nothing: the weight gradient made apart from the input gradient (16-bit weights, or
autocast), as it is made anyway. An fp32 head computed in fp32 sums it in the input gradient's pass, which a
later gradient would have to repeat (two more head GEMMs): it is left there.
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["HeadGradLater", "HEAD_GRAD_LATER", "head_grad_later_of"]

HEAD_GRAD_LATER = "_slimfit_head_grad_later"   # on the head's alias of a tied weight (sparse_embedding.tied_uses)


class HeadGradLater:
    """The head's weight gradient, to be made by whoever holds this: each loss on the head ``keep``s how to make
    its part, the tied weight's backward ``take``s their sum (None when no loss kept one: the head needed no
    gradient, or made it itself)."""

    def __init__(self):
        self._makers: list[Callable[[], torch.Tensor]] = []

    def keep(self, make: Callable[[], torch.Tensor]) -> None:
        self._makers.append(make)

    def take(self) -> torch.Tensor | None:
        makers, self._makers = self._makers, []   # once: what they hold is freed with them
        total = None
        for make in makers:   # one per loss computed on the head (one in a patched model's forward)
            grad = make()
            total = grad if total is None else total.add_(grad)
        return total


def head_grad_later_of(weight: torch.Tensor) -> HeadGradLater | None:
    """The HeadGradLater on a head weight (an alias made by tied_uses), None for any other weight."""
    return getattr(weight, HEAD_GRAD_LATER, None)
