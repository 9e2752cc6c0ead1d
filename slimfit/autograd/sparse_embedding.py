"""A tied embedding's gradient without a second vocabulary-sized tensor.

    for_embedding, for_head = tied_uses(weight)                      # two aliases of the one parameter
    hidden = embedding_sparse_grad(ids, for_embedding, padding_idx)   # the values of F.embedding(ids, weight)
    loss = causal_lm_loss(hidden_out, for_head, None, labels)

Why: a causal LM whose head weight is its input embedding's (Qwen2.5-0.5B/1.5B, Llama-3.2-1B/3B, SmolLM2) gets
two gradients of that (vocab, hidden) parameter in backward. PyTorch's embedding backward makes its one dense, so
two vocabulary-sized tensors are alive when autograd adds them (Qwen2.5-0.5B in bf16: 2 x 260 MiB; Llama-3.2-1B:
2 x 501 MiB). Here the lookup's gradient is sparse (one row of values per token), and `tied_uses` receives both
gradients in one backward and adds the sparse one into the head's dense one in place, so the parameter gets one
dense gradient and the step never holds two. (Autograd's own sum of two gradients of one tensor would not do it:
it adds a sparse summand into a dense one out of place, a second dense tensor.)

Numerics: the rows of one token are summed in fp32 in the order of their positions and rounded once to the
weight's dtype. In fp32 that is PyTorch's dense embedding backward, so the summed gradient is bit-identical to the
unpatched model's (tested). In bf16/fp16 PyTorch's CPU backward sums in the weight's dtype: this gradient is the
more accurate one (a token repeated 256 times: 11x nearer an fp64 sum), and differs from PyTorch's in the last
bits where a token repeats.

Shapes are static (a stable sort and a segment sum; no `unique`, whose output size would make a GPU wait for the
host): a token's sum sits on the row of its first occurrence in sorted order and its other rows are exact zeros,
so the sparse tensor is uncoalesced, with duplicate indices whose extra values add nothing. `tied_uses` makes a
gradient that arrives alone (only the lookup's, say) dense before it leaves, so `.grad` is always dense.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import backward_once
from .head_grad_later import HEAD_GRAD_LATER, HeadGradLater

__all__ = ["embedding_sparse_grad", "sparse_rows_gradient", "tied_uses"]


def sparse_rows_gradient(ids: torch.Tensor, grad_out: torch.Tensor, weight_shape, weight_dtype,
                         padding_idx: int | None) -> torch.Tensor:
    """The sparse COO gradient of an embedding weight of `weight_shape` from the lookup's output gradient.

    One value row per token, in sorted token order: each token's rows summed in fp32 (stable sort: in the
    order of their positions) on its first row, rounded once to `weight_dtype`; its other rows zero. The
    padding row (`padding_idx`) gets no gradient, as PyTorch's."""
    flat = ids.reshape(-1)
    n, hidden = flat.numel(), weight_shape[1]
    rows = grad_out.reshape(n, hidden)
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    first = torch.ones(n, dtype=torch.bool, device=flat.device)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    positions = torch.arange(n, device=flat.device)
    segment = torch.where(first, positions, torch.zeros_like(positions)).cummax(0).values
    sums = torch.zeros((n, hidden), dtype=torch.float32, device=rows.device)
    sums.index_add_(0, segment, rows[order].float())
    if padding_idx is not None:
        sums.masked_fill_((sorted_ids == padding_idx)[:, None], 0.0)
    return torch.sparse_coo_tensor(sorted_ids[None], sums.to(weight_dtype), tuple(weight_shape),
                                   check_invariants=False)


class _EmbeddingSparseGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.weight_shape, ctx.weight_dtype, ctx.padding_idx = weight.shape, weight.dtype, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    @backward_once("embedding_sparse_grad")
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        grad = sparse_rows_gradient(ids, grad_out, ctx.weight_shape, ctx.weight_dtype, ctx.padding_idx)
        return None, grad, None


def embedding_sparse_grad(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """`F.embedding(ids, weight, padding_idx)` whose weight gradient is sparse (see the module docstring)."""
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"embedding_sparse_grad: ids must be int32 or int64, got {ids.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"embedding_sparse_grad: weight must be 2-D (vocab, hidden), got shape {tuple(weight.shape)}")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return _EmbeddingSparseGrad.apply(ids, weight, padding_idx)


class _TiedUses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, later):
        ctx.set_materialize_grads(False)  # a use with no gradient gives None, not a vocabulary-sized zero tensor
        ctx.later = later
        return weight.view_as(weight), weight.view_as(weight)

    @staticmethod
    @backward_once("tied_uses")
    def backward(ctx, grad_embedding, grad_head):
        later = ctx.later.take()   # the chunked loss's weight gradient, made now (head_grad_later.py)
        if later is not None:
            grad_head = later if grad_head is None else grad_head + later
        return _sum_of_uses(grad_embedding, grad_head), None


def _sum_of_uses(grad_embedding, grad_head):
    """The tied weight's one dense gradient from its two uses' (either may be None or sparse)."""
    if grad_embedding is None or grad_head is None:
        grad = grad_head if grad_embedding is None else grad_embedding
        return None if grad is None else (grad.to_dense() if grad.is_sparse else grad)
    if grad_head.is_sparse:
        grad_embedding, grad_head = grad_head, grad_embedding
    if grad_head.is_sparse:
        return (grad_head + grad_embedding).to_dense()
    if grad_head._base is not None or not grad_head.is_contiguous():
        return grad_head + grad_embedding
    return grad_head.add_(grad_embedding)  # in place: the head's gradient was made for this sum alone


def tied_uses(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two aliases of `weight` (no copy), one for the embedding lookup and one for the head: their gradients are
    added in one backward, a sparse one into the dense one in place, and reach `weight` dense. The head's alias
    carries a HeadGradLater: the chunked loss leaves its weight gradient to be made here (head_grad_later.py)."""
    later = HeadGradLater()
    for_embedding, for_head = _TiedUses.apply(weight, later)
    setattr(for_head, HEAD_GRAD_LATER, later)   # the chunked loss finds it on the head's alias
    return for_embedding, for_head
