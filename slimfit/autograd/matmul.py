"""Batched matmul of two activations, each side optionally saved quantized.

out = a @ b with a (..., n, k), b (..., k, m) and broadcastable batch dimensions.
    grad_a = grad @ b^T   needs b, saved only when a requires grad (b_bits: 8/4/2 bits or None = full)
    grad_b = a^T @ grad   needs a, saved only when b requires grad (a_bits likewise)
Under autocast both sides are cast to the autocast dtype, as torch.matmul is.
Options: `MatmulOptions` (each side's bits, the group size, rounding, the NaN/Inf check), checked once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ._common import (
    autocast_dtype,
    backward_once,
    call_options,
    check_bits,
    check_flag,
    check_float,
    check_group_size,
    check_same_device,
    check_same_dtype,
    compress_quantize,
    load,
    no_autocast,
    restore,
    save,
)

__all__ = ["matmul", "MatmulOptions"]


@dataclass(frozen=True)
class MatmulOptions:
    """What is saved of each side: in full (None) or quantized to 8/4/2 bits per group of `group_size`,
    rounded to nearest or stochastically; `check_finite` raises on NaN/Inf in what is saved. Checked once."""

    op: ClassVar[str] = "matmul"
    a_bits: int | None = None
    b_bits: int | None = None
    group_size: int = 128
    stochastic: bool = False
    check_finite: bool = False

    def __post_init__(self):
        check_bits(self.op, "a_bits", self.a_bits, allow_none=True)
        check_bits(self.op, "b_bits", self.b_bits, allow_none=True)
        check_group_size(self.op, self.group_size)
        check_flag(self.op, stochastic=self.stochastic, check_finite=self.check_finite)


def _save_side(t: torch.Tensor, bits, options: MatmulOptions):
    return t if bits is None else compress_quantize(t, bits, options.group_size, options.stochastic,
                                                    options.check_finite)


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, options, compute_dtype):
        device_type = a.device.type
        with no_autocast(device_type):
            ac, bc = a.to(compute_dtype), b.to(compute_dtype)
            out = torch.matmul(ac, bc)
        need_a, need_b = ctx.needs_input_grad[:2]
        save(
            ctx,
            _save_side(ac, options.a_bits, options) if need_b else None,
            _save_side(bc, options.b_bits, options) if need_a else None,
        )
        ctx.device_type, ctx.compute_dtype = device_type, compute_dtype
        ctx.a_shape, ctx.b_shape = tuple(a.shape), tuple(b.shape)
        ctx.a_dtype, ctx.b_dtype = a.dtype, b.dtype
        return out

    @staticmethod
    @backward_once("matmul")
    def backward(ctx, grad_out):
        saved_a, saved_b = load(ctx)
        need_a, need_b = ctx.needs_input_grad[:2]
        cd = ctx.compute_dtype
        grad_a = grad_b = None
        with no_autocast(ctx.device_type):
            g = grad_out.to(cd)
            if need_a:
                b = restore(saved_b, cd)
                grad_a = torch.matmul(g, b.transpose(-1, -2)).sum_to_size(ctx.a_shape).to(ctx.a_dtype)
            if need_b:
                a = restore(saved_a, cd)
                grad_b = torch.matmul(a.transpose(-1, -2), g).sum_to_size(ctx.b_shape).to(ctx.b_dtype)
        return grad_a, grad_b, None, None


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    a_bits: int | None = None,
    b_bits: int | None = None,
    group_size: int = 128,
    stochastic: bool = False,
    check_finite: bool = False,
    options: MatmulOptions | None = None,
) -> torch.Tensor:
    """`torch.matmul(a, b)` for a, b of at least 2 dimensions; a_bits / b_bits quantize what
    is saved of each side (None keeps it in full). options: a MatmulOptions built once, instead of
    the keywords: not checked again."""
    check_float("matmul", "a", a)
    check_float("matmul", "b", b)
    options = call_options(MatmulOptions, options, a_bits=a_bits, b_bits=b_bits, group_size=group_size,
                           stochastic=stochastic, check_finite=check_finite)
    check_same_device("matmul", a=a, b=b)
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError(
            f"slimfit.matmul: both operands need at least 2 dimensions, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(
            f"slimfit.matmul: mismatched shapes: a {tuple(a.shape)} @ b {tuple(b.shape)} "
            f"({a.shape[-1]} != {b.shape[-2]})"
        )
    try:
        torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"slimfit.matmul: mismatched shapes: batch dimensions {tuple(a.shape[:-2])} and "
            f"{tuple(b.shape[:-2])} do not broadcast"
        ) from None
    compute_dtype = autocast_dtype(a.device.type)
    if compute_dtype is None:
        check_same_dtype("matmul", a=a, b=b)
        compute_dtype = a.dtype
    if not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
        return torch.matmul(a, b)
    return _Matmul.apply(a, b, options, compute_dtype)
