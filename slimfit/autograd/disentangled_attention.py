"""DeBERTa's disentangled attention with nothing of size S×S kept for backward.

    scores = Q·(Kᵀ/s) + gather(Q·Pkᵀ, c2p)/s + gather(K·Pqᵀ, p2c)ᵀ/s       (s = sqrt(d · (1 + #position terms)))
    P = softmax(masked_fill(scores, ~mask, min))        O = dropout(P)·V

Pk, Pq are the projected relative-position embeddings of each head ((H, 2A, d): small), c2p / p2c the
relative distance of every (query, key) pair clamped into the 2A buckets, both from the model's
`relative_pos`. PyTorch keeps P, the dropped P and its mask, the two gathered S×S bias terms' indices and
Q, K twice. This keeps Q, K, V quantized (`AttentionOptions.qkv_bits`), Pk and Pq (small), and references
to the model's `relative_pos` and mask (each one tensor shared by every layer): backward rebuilds the
scores and P from them, regenerates the dropout mask from a seed, and runs the gradient of every term:

    dS = P∘(dP − rowsum(dP∘P))      dQ = dS·K/s + scatter(dS, c2p)/s·Pk      dK = dSᵀ·Q/s + scatter(dSᵀ, p2c)/s·Pq
    dPk = Σ_batch scatter(dS, c2p)ᵀ·Q/s      dPq = Σ_batch scatter(dSᵀ, p2c)ᵀ·K/s

The forward runs the model's own ops in its order, so its output is the model's bit for bit when the
dropout is off (slimfit/patching/attention/disentangled.py checks that on a probe at patch time). The attention
dropout is slimfit's seeded one (the same distribution as PyTorch's, another draw), as for every attention.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels.api import quantize
from ..kernels.reference import apply_keep
from ._common import backward_once, load, no_autocast, restore, save
from .dropout import apply_seeded_dropout, draw_seed, keep_mask

__all__ = ["disentangled_attention", "position_index"]


def position_index(relative_pos: Tensor, span: int, sign: int) -> Tensor:
    """The (S, S) bucket of each (query, key) pair: clamp(sign · relative_pos + span) into [0, 2·span)."""
    return torch.clamp((-relative_pos if sign < 0 else relative_pos) + span, 0, span * 2 - 1)


def _repeat(pos: Tensor, batch: int) -> Tensor:
    """(H, 2A, d) -> (B·H, 2A, d), as the model repeats its position projections over the batch."""
    return pos.repeat(batch, 1, 1)


def _scores(q, k, pos_key, pos_query, rel, span: int, scale: Tensor, batch: int) -> Tensor:
    """The scores as the model computes them (same ops, same order): (B·H, S, S)."""
    scores = torch.bmm(q, k.transpose(-1, -2) / scale.to(dtype=q.dtype))
    bias = 0
    if pos_key is not None:
        c2p = torch.bmm(q, _repeat(pos_key, batch).transpose(-1, -2))
        index = position_index(rel, span, 1).squeeze(0).expand([q.size(0), q.size(1), rel.size(-1)])
        bias = bias + torch.gather(c2p, dim=-1, index=index) / scale.to(dtype=c2p.dtype)
    if pos_query is not None:
        p2c = torch.bmm(k, _repeat(pos_query, batch).transpose(-1, -2))
        index = position_index(rel, span, -1).squeeze(0).expand([q.size(0), k.size(-2), k.size(-2)])
        bias = bias + torch.gather(p2c, dim=-1, index=index).transpose(-1, -2) / scale.to(dtype=p2c.dtype)
    if pos_key is not None or pos_query is not None:
        scores = scores + bias
    return scores


def _probs(scores: Tensor, mask: Tensor, heads: int) -> Tensor:
    """softmax(masked_fill(scores, ~mask, min)) as the model computes it: (B, H, S, S)."""
    scores = scores.view(-1, heads, scores.size(-2), scores.size(-1))
    scores = scores.masked_fill(~(mask.bool()), torch.finfo(scores.dtype).min)
    return torch.nn.functional.softmax(scores, dim=-1)


def _scatter(grad: Tensor, rel: Tensor, span: int, sign: int) -> Tensor:
    """The gradient of the (B·H, S, 2A) table a gather by the pairs' buckets read: each pair's gradient added
    into its bucket."""
    index = position_index(rel, span, sign).squeeze(0).expand(grad.shape)
    table = grad.new_zeros(grad.shape[:-1] + (2 * span,))
    return table.scatter_add_(-1, index, grad)


class _DisentangledFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pos_key, pos_query, rel, mask, span, scale, heads, dropout_p, options):
        batch = q.size(0) // heads
        seed = draw_seed() if dropout_p > 0.0 else None
        probs = _probs(_scores(q, k, pos_key, pos_query, rel, span, scale, batch), mask, heads)
        probs = probs.view(-1, probs.size(-2), probs.size(-1))
        if seed is not None:
            probs = apply_seeded_dropout(probs, dropout_p, seed)
        out = torch.bmm(probs, v)
        bits = options.qkv_bits
        kept = (q, k, v) if bits is None else tuple(quantize(x, bits, options.group_size) for x in (q, k, v))
        save(ctx, *kept, pos_key, pos_query, rel, mask)
        ctx.meta = (span, scale, heads, batch, dropout_p, seed, q.dtype, q.device.type)
        return out

    @staticmethod
    @backward_once("disentangled attention")
    def backward(ctx, grad_out):
        span, scale, heads, batch, dropout_p, seed, dtype, device_type = ctx.meta
        with no_autocast(device_type):
            saved_q, saved_k, saved_v, pos_key, pos_query, rel, mask = load(ctx)
            q, k, v = (restore(x, dtype) for x in (saved_q, saved_k, saved_v))
            del saved_q, saved_k, saved_v
            probs = _probs(_scores(q, k, pos_key, pos_query, rel, span, scale, batch), mask, heads)
            probs = probs.view(-1, probs.size(-2), probs.size(-1))
            grad_out = grad_out.to(dtype)
            if seed is not None:
                keep = keep_mask(probs, dropout_p, seed)
                grad_v = torch.bmm(apply_keep(probs, keep, dropout_p).transpose(-2, -1), grad_out)
                grad_p = apply_keep(torch.bmm(grad_out, v.transpose(-2, -1)), keep, dropout_p)
                del keep
            else:
                grad_v = torch.bmm(probs.transpose(-2, -1), grad_out)
                grad_p = torch.bmm(grad_out, v.transpose(-2, -1))
            del v
            grad_s = torch.ops.aten._softmax_backward_data(grad_p, probs, -1, probs.dtype)
            del grad_p, probs
            # masked_fill's gradient: none at a masked pair (a query row masked whole has uniform P, not zeros)
            grad_s = grad_s.view(batch, heads, *grad_s.shape[-2:]).masked_fill(~(mask.bool()), 0.0)
            grad_s = grad_s.view(-1, *grad_s.shape[-2:])
            grad_s = grad_s / scale.to(dtype=grad_s.dtype)   # every term of the scores is divided by s
            grad_q = torch.bmm(grad_s, k)
            grad_k = torch.bmm(q.transpose(-2, -1), grad_s).transpose(-2, -1)
            grad_pk = grad_pq = None
            if pos_key is not None:
                table = _scatter(grad_s, rel, span, 1)
                grad_q = grad_q + torch.bmm(table, _repeat(pos_key, batch))
                grad_pk = torch.bmm(table.transpose(-2, -1), q).view(batch, *pos_key.shape).sum(0)
                del table
            if pos_query is not None:
                table = _scatter(grad_s.transpose(-2, -1), rel, span, -1)
                grad_k = grad_k + torch.bmm(table, _repeat(pos_query, batch))
                grad_pq = torch.bmm(table.transpose(-2, -1), k).view(batch, *pos_query.shape).sum(0)
                del table
        return grad_q, grad_k, grad_v, grad_pk, grad_pq, None, None, None, None, None, None, None


def disentangled_attention(q: Tensor, k: Tensor, v: Tensor, pos_key: Optional[Tensor], pos_query: Optional[Tensor],
                           relative_pos: Tensor, mask: Tensor, span: int, scale: Tensor, heads: int,
                           dropout_p: float, options) -> Tensor:
    """dropout(P)·V of DeBERTa's attention, (B·H, S, d). q, k, v: (B·H, S, d); pos_key / pos_query: (H, 2A, d)
    or None (the c2p / p2c term absent); relative_pos: (1, 1, S, S) integer distances; mask: (B, 1, S, S),
    nonzero where a query may see a key; span: A; scale: the model's 0-dim s; options: AttentionOptions
    (qkv_bits, group_size)."""
    return _DisentangledFn.apply(q, k, v, pos_key, pos_query, relative_pos, mask, span, scale, heads,
                                 float(dropout_p), options)
