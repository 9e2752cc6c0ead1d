"""How the chunked step cuts parameters into pieces and packs them into calls.

A piece is (param index, start, end), at most ``chunk_numel`` elements of one parameter, cut at multiples of
``chunk_numel`` from its first element; consecutive pieces are packed into one call of at most ``chunk_numel``
elements. Where a piece starts fixes its stochastic-rounding seed (weight_rounding.py) and a call's pieces share
one rounding stream, so every step that takes moments in full or from the host cuts and packs alike: their
weights are the same bit for bit.
"""
from __future__ import annotations

__all__ = ["factor_runs"]


def _pieces(params, chunk_numel):
    """(param index, start, end) over every parameter, each at most chunk_numel long, in order."""
    for i, p in enumerate(params):
        n = p.numel()
        for a in range(0, max(n, 1), chunk_numel):
            yield i, a, min(n, a + chunk_numel)


def _packed(params, chunk_numel):
    """Consecutive pieces packed into calls of at most chunk_numel elements (one piece may fill a call)."""
    batch, size = [], 0
    for piece in _pieces(params, chunk_numel):
        n = piece[2] - piece[1]
        if batch and size + n > chunk_numel:
            yield batch
            batch, size = [], 0
        batch.append(piece)
        size += n
    if batch:
        yield batch


def factor_runs(ps, factors, chunk_numel):
    """(factor, batch of (param index, start, end)) over ``ps``: pieces of parameters stretched alike share a
    call; the parameters keep their order within a factor."""
    for f in dict.fromkeys(factors):
        idx = [i for i, g in enumerate(factors) if g == f]
        for batch in _packed([ps[i] for i in idx], chunk_numel):
            yield f, [(idx[j], a, b) for j, a, b in batch]
