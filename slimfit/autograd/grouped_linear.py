"""A grouped linear over rows sorted by expert, saving only what its backward needs: a mixture of experts'
projections as transformers' grouped experts forward computes them.

    out[r] = rows[r] @ weight[e(r)].T      rows sorted by expert, offsets[e] = end of expert e's rows
    rows = x[gather] when `gather` is given (each token's hidden state once per expert it is routed to)

The forward product is the caller's own grouped GEMM (`mm(rows, weight, offsets)`: the model's, so the output
is bit-identical to its forward). Backward:
    grad_rows = the same grouped GEMM of the gradient with the weight (E, out, in) taken as transposed;
    grad_x    = grad_rows added back to the gathered positions (what autograd's gather backward does);
    grad_w[e] = (rows of e)^T grad (of e), as PyTorch's grouped_mm backward computes it.
With the weight frozen nothing is saved but the weight itself (a parameter) and no weight gradient is computed.
With it trained, the source `x` is saved once (T rows, not the k*T gathered ones: the router's linear keeps
the same tensor, so in full it costs nothing more), in full or quantized per `LinearOptions`.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ._common import backward_once, call_options, check_float, check_same_device, compress_quantize, load, restore, save
from .linear import LinearOptions

__all__ = ["grouped_linear", "grouped_weight_grad"]

GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """rows (S, in) @ weight[e] (in, out) per group: PyTorch's grouped_mm, or one mm per expert without it."""
    if hasattr(F, "grouped_mm"):
        return F.grouped_mm(rows, weight, offs=offsets)
    out = rows.new_zeros(rows.shape[0], weight.shape[-1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(rows[start:end], weight[e], out=out[start:end])
        start = end
    return out


def grouped_weight_grad(rows: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(E, out, in): each expert's grad rows^T @ its input rows, as PyTorch's grouped_mm backward forms it
    (rows^T grad per group, then transposed), zero for an expert with no rows."""
    if hasattr(F, "grouped_mm"):
        try:
            return F.grouped_mm(rows.t(), grad, offs=offsets).transpose(-2, -1)
        except (RuntimeError, NotImplementedError):   # a device or dtype its kernel does not take: per expert
            pass
    out = grad.new_zeros(offsets.numel(), grad.shape[1], rows.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[e] = rows[start:end].t().mm(grad[start:end]).t()
        start = end
    return out


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offsets, gather, mm, options):
        rows = x if gather is None else x[gather]
        out = mm(rows.to(weight.dtype), weight.transpose(-2, -1), offsets)   # weight (E, out, in) as (E, in, out)
        need_x, need_w = ctx.needs_input_grad[:2]
        source = None
        if need_w:
            source = x if options.input_bits is None else compress_quantize(
                x, options.input_bits, options.group_size, options.stochastic, options.check_finite)
        save(ctx, weight if need_x else None, source, offsets, gather)
        ctx.mm, ctx.x_dtype, ctx.x_rows, ctx.w_dtype = mm, x.dtype, x.shape[0], weight.dtype
        return out

    @staticmethod
    @backward_once("grouped_linear")
    def backward(ctx, grad_out):
        weight, source, offsets, gather = load(ctx)
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = grad_w = None
        g = grad_out.to(ctx.w_dtype)
        if need_x:
            grad_rows = ctx.mm(g, weight, offsets)   # g @ weight[e]: (S, out) -> (S, in)
            if gather is None:
                grad_x = grad_rows.to(ctx.x_dtype)
            else:
                grad_x = grad_rows.new_zeros(ctx.x_rows, grad_rows.shape[1])
                grad_x.index_put_((gather,), grad_rows, accumulate=True)
                grad_x = grad_x.to(ctx.x_dtype)
        if need_w:
            x = restore(source, ctx.w_dtype)
            rows = x if gather is None else x[gather]
            grad_w = grouped_weight_grad(rows, g, offsets)
        return grad_x, grad_w, None, None, None, None


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    *,
    gather: torch.Tensor | None = None,
    mm: GroupedMM | None = None,
    input_bits: int | None = None,
    group_size: int = 128,
    stochastic: bool = False,
    check_finite: bool = False,
    options: LinearOptions | None = None,
) -> torch.Tensor:
    """Rows sorted by expert through their expert's weight (see the module docstring).

    x: (T, in), the rows themselves or (with `gather`, int indices of shape (S,)) what they are gathered from;
    weight: (E, out, in); offsets: (E,) int, the cumulative row counts per expert; mm(rows, weight_t, offsets)
    with weight_t (E, in, out): the grouped GEMM of the forward (default PyTorch's grouped_mm); options: as
    `linear`'s (what a trained weight keeps of its input)."""
    check_float("grouped_linear", "input", x)
    check_float("grouped_linear", "weight", weight)
    options = call_options(LinearOptions, options, input_bits=input_bits, group_size=group_size,
                           stochastic=stochastic, check_finite=check_finite)
    check_same_device("grouped_linear", input=x, weight=weight, offsets=offsets)
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"slimfit.grouped_linear: needs x (T, in) and weight (E, out, in), got x {tuple(x.shape)} "
                         f"and weight {tuple(weight.shape)}")
    if offsets.dim() != 1 or offsets.numel() != weight.shape[0] or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slimfit.grouped_linear: offsets must be ({weight.shape[0]},) int32/int64 (one end per "
                         f"expert), got {tuple(offsets.shape)} {offsets.dtype}")
    if gather is not None and (gather.dim() != 1 or gather.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"slimfit.grouped_linear: gather must be 1-D int32/int64 row indices into x, got "
                         f"{tuple(gather.shape)} {gather.dtype}")
    mm = mm or _grouped_mm
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return mm((x if gather is None else x[gather]).to(weight.dtype), weight.transpose(-2, -1), offsets)
    return _GroupedLinear.apply(x, weight, offsets, gather, mm, options)
