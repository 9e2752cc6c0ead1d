"""LayerNorm that saves only the normalized output x_hat (compressed) and the per-row rstd.

With g the output gradient, w the weight (1 when None), D the normalized size:
    gw = g * w
    dx = rstd * (gw - mean(gw) - x_hat * mean(gw * x_hat))       (means over the D entries of a row)
    dw = sum over rows of g * x_hat,   db = sum over rows of g
so backward needs x_hat and rstd only. x_hat is saved as
    'int8'  8-bit codes per group of `group_size` (x_hat has unit RMS per row: one scale fits)
    'topk'  the `keep_ratio` largest-magnitude entries of each row (values in the input dtype,
            int16 indices) -- the SlimFit code keeps 10% when the LayerNorm weight is frozen
    'full'  uncompressed, in the input dtype.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._common import (
    autocast_dtype, backward_once, cast, check_float, check_group_size, compress_quantize,
    compress_topk, load, no_autocast, restore, save,
)

__all__ = ["layer_norm", "topk_keep"]

_MODES = ("int8", "topk", "full")


def topk_keep(keep_ratio: float, row_length: int) -> int:
    """Entries of x_hat kept per row: ceil(keep_ratio * D), at least 1 (a tiny tolerance keeps
    float noise from adding one: 0.1 * 30 = 3.0000000000000004)."""
    return min(row_length, max(1, math.ceil(keep_ratio * row_length - 1e-9)))


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps, mode, keep_ratio, group_size, stochastic, compute_dtype,
                check_finite=False):
        device_type = x.device.type
        with no_autocast(device_type):
            xc = x if compute_dtype is None else x.to(compute_dtype)
            wc = weight if compute_dtype is None else cast(weight, compute_dtype)
            bc = bias if compute_dtype is None else cast(bias, compute_dtype)
            out = F.layer_norm(xc, normalized_shape, wc, bc, eps)
            d = math.prod(normalized_shape)
            rows = xc.numel() // d
            x2 = xc.reshape(rows, d).to(torch.float32)
            xhat, _, rstd = torch.native_layer_norm(x2, (d,), None, None, eps)
            if mode == "int8":
                saved = compress_quantize(xhat, 8, group_size, stochastic, check_finite)
            elif mode == "topk":
                saved = compress_topk(xhat.to(xc.dtype), topk_keep(keep_ratio, d), check_finite)
            else:
                saved = xhat.to(xc.dtype)
        save(ctx, saved, rstd, weight if ctx.needs_input_grad[0] else None)
        ctx.device_type = device_type
        ctx.rows, ctx.d = rows, d
        ctx.normalized_shape = tuple(normalized_shape)
        ctx.x_shape, ctx.x_dtype = tuple(x.shape), x.dtype
        ctx.w_dtype = None if weight is None else weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    @backward_once("layer_norm")
    def backward(ctx, grad_out):
        saved, rstd, weight = load(ctx)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        with no_autocast(ctx.device_type):
            g = grad_out.to(torch.float32).reshape(ctx.rows, ctx.d)
            xhat = None
            if need_x or need_w:
                xhat = restore(saved, torch.float32).reshape(ctx.rows, ctx.d)
            if need_x:
                gw = g if weight is None else g * weight.to(torch.float32).reshape(ctx.d)
                c1 = gw.mean(dim=1, keepdim=True)
                c2 = (gw * xhat).mean(dim=1, keepdim=True)
                grad_x = (rstd * (gw - c1 - xhat * c2)).view(ctx.x_shape).to(ctx.x_dtype)
            if need_w:
                grad_w = (g * xhat).sum(0).view(ctx.normalized_shape).to(ctx.w_dtype)
            if need_b:
                grad_b = g.sum(0).view(ctx.normalized_shape).to(ctx.b_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None


def layer_norm(
    x: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    save: str = "int8",
    keep_ratio: float = 0.1,
    group_size: int = 128,
    stochastic: bool = False,
    check_finite: bool = False,
) -> torch.Tensor:
    """`F.layer_norm` saving x_hat per `save` ('int8' | 'topk' | 'full') plus fp32 rstd per row.

    Output dtype: as PyTorch (under CUDA autocast layer_norm runs in fp32; CPU autocast leaves
    it alone)."""
    check_float("layer_norm", "input", x)
    check_float("layer_norm", "weight", weight)
    check_float("layer_norm", "bias", bias)
    if save not in _MODES:
        raise ValueError(f"slimfit.layer_norm: save must be one of {_MODES}, got {save!r}")
    if save == "topk" and not (0.0 < keep_ratio <= 1.0):
        raise ValueError(f"slimfit.layer_norm: keep_ratio must be in (0, 1], got {keep_ratio}")
    check_group_size("layer_norm", group_size)
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    normalized_shape = tuple(int(s) for s in normalized_shape)
    n = len(normalized_shape)
    if n == 0 or x.dim() < n or tuple(x.shape[x.dim() - n:]) != normalized_shape:
        raise ValueError(
            f"slimfit.layer_norm: mismatched shapes: input {tuple(x.shape)} does not end with "
            f"normalized_shape {normalized_shape}"
        )
    if math.prod(normalized_shape) == 0:
        raise ValueError("slimfit.layer_norm: normalized_shape must not contain a zero")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != normalized_shape:
            raise ValueError(
                f"slimfit.layer_norm: mismatched shapes: {name} {tuple(t.shape)} must equal "
                f"normalized_shape {normalized_shape}"
            )
    # PyTorch's autocast runs layer_norm in fp32 on CUDA; CPU autocast does not touch it.
    compute_dtype = torch.float32 if (x.device.type == "cuda" and autocast_dtype("cuda") is not None) else None
    needs_graph = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias)
    )
    if not needs_graph:
        return F.layer_norm(x, normalized_shape, weight, bias, eps)
    return _LayerNorm.apply(
        x, weight, bias, normalized_shape, float(eps), save, float(keep_ratio), group_size,
        bool(stochastic), compute_dtype, bool(check_finite),
    )
