"""Rows scaled by one weight each, the rows saved compressed: a mixture of experts' routing product.

out = y * w[..., None] with y (..., n) and w (...): each expert's output rows times their routing weights.
    grad_y = grad * w          needs w (one number per row: kept as it is)
    grad_w = (grad * y).sum(-1)  needs y, saved only when w requires grad, at `bits` (8/4/2) or in full (None)
The product is PyTorch's `y * w[..., None]` itself (its type promotion: bf16 rows with fp32 weights give
fp32), so the forward is bit-identical; mul is not an autocast op, nor is this. Options: `RowScaleOptions`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ._common import (
    backward_once,
    call_options,
    check_bits,
    check_flag,
    check_float,
    check_group_size,
    check_same_device,
    compress_quantize,
    load,
    restore,
    save,
)

__all__ = ["row_scale", "RowScaleOptions"]


@dataclass(frozen=True)
class RowScaleOptions:
    """What is saved of the rows: in full (None) or quantized to 8/4/2 bits per group of `group_size`, rounded
    to nearest or stochastically; `check_finite` raises on NaN/Inf in what is saved. Checked once."""

    op: ClassVar[str] = "row_scale"
    bits: int | None = 8
    group_size: int = 128
    stochastic: bool = False
    check_finite: bool = False

    def __post_init__(self):
        check_bits(self.op, "bits", self.bits, allow_none=True)
        check_group_size(self.op, self.group_size)
        check_flag(self.op, stochastic=self.stochastic, check_finite=self.check_finite)


class _RowScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w, options):
        out = y * w[..., None]
        need_y, need_w = ctx.needs_input_grad[:2]
        rows = None
        if need_w:
            rows = y if options.bits is None else compress_quantize(y, options.bits, options.group_size,
                                                                    options.stochastic, options.check_finite)
        save(ctx, rows, w if need_y else None)
        ctx.y_dtype, ctx.w_dtype = y.dtype, w.dtype
        return out

    @staticmethod
    @backward_once("row_scale")
    def backward(ctx, grad_out):
        rows, w = load(ctx)
        need_y, need_w = ctx.needs_input_grad[:2]
        grad_y = (grad_out * w[..., None]).to(ctx.y_dtype) if need_y else None
        grad_w = None
        if need_w:
            y = restore(rows, grad_out.dtype)
            grad_w = (grad_out * y).sum(-1).to(ctx.w_dtype)
        return grad_y, grad_w, None


def row_scale(
    y: torch.Tensor,
    w: torch.Tensor,
    *,
    bits: int | None = 8,
    group_size: int = 128,
    stochastic: bool = False,
    check_finite: bool = False,
    options: RowScaleOptions | None = None,
) -> torch.Tensor:
    """`y * w[..., None]` for rows y (..., n) and one weight per row w (...); the rows are saved at `bits` for
    w's gradient (None: in full). options: a RowScaleOptions built once, instead of the keywords."""
    check_float("row_scale", "y", y)
    check_float("row_scale", "w", w)
    options = call_options(RowScaleOptions, options, bits=bits, group_size=group_size, stochastic=stochastic,
                           check_finite=check_finite)
    check_same_device("row_scale", y=y, w=w)
    if y.dim() < 1 or tuple(w.shape) != tuple(y.shape[:-1]):
        raise ValueError(f"slimfit.row_scale: w must have one weight per row of y: y {tuple(y.shape)} needs w of "
                         f"shape {tuple(y.shape[:-1])}, got {tuple(w.shape)}")
    if not (torch.is_grad_enabled() and (y.requires_grad or w.requires_grad)):
        return y * w[..., None]
    return _RowScale.apply(y, w, options)
