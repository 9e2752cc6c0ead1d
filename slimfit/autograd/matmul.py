"""Batched matmul of two activations, each side optionally saved quantized.

out = a @ b with a (..., n, k), b (..., k, m) and broadcastable batch dimensions.
    grad_a = grad @ b^T   needs b, saved only when a requires grad (b_bits: 8/4/2 bits or None = full)
    grad_b = a^T @ grad   needs a, saved only when b requires grad (a_bits likewise)
Under autocast both sides are cast to the autocast dtype, as torch.matmul is.
"""
from __future__ import annotations

import torch

from ._common import (
    autocast_dtype,
    backward_once,
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

__all__ = ["matmul"]


def _save_side(t: torch.Tensor, bits, group_size, stochastic, check_finite=False):
    return t if bits is None else compress_quantize(t, bits, group_size, stochastic, check_finite)


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, a_bits, b_bits, group_size, stochastic, compute_dtype, check_finite=False):
        device_type = a.device.type
        with no_autocast(device_type):
            ac, bc = a.to(compute_dtype), b.to(compute_dtype)
            out = torch.matmul(ac, bc)
        need_a, need_b = ctx.needs_input_grad[:2]
        save(
            ctx,
            _save_side(ac, a_bits, group_size, stochastic, check_finite) if need_b else None,
            _save_side(bc, b_bits, group_size, stochastic, check_finite) if need_a else None,
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
        return grad_a, grad_b, None, None, None, None, None, None


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    a_bits: int | None = None,
    b_bits: int | None = None,
    group_size: int = 128,
    stochastic: bool = False,
    check_finite: bool = False,
) -> torch.Tensor:
    """`torch.matmul(a, b)` for a, b of at least 2 dimensions; a_bits / b_bits quantize what
    is saved of each side (None keeps it in full)."""
    check_float("matmul", "a", a)
    check_float("matmul", "b", b)
    check_bits("matmul", "a_bits", a_bits, allow_none=True)
    check_bits("matmul", "b_bits", b_bits, allow_none=True)
    check_group_size("matmul", group_size)
    check_flag("matmul", stochastic=stochastic, check_finite=check_finite)
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
    return _Matmul.apply(a, b, a_bits, b_bits, group_size, bool(stochastic), compute_dtype,
                         bool(check_finite))
