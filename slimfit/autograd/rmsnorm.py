"""RMSNorm (Llama / Mistral / Qwen2 layout) that saves only x_hat (compressed) and the per-row rstd.

The forward is the Hugging Face formula, op for op, so the output is bit-identical:
    h     = x.to(float32)
    rstd  = rsqrt(mean(h², -1) + eps)
    x_hat = h * rstd                                   (fp32)
    y     = weight * x_hat.to(x.dtype)                 (weight None: y = x_hat.to(x.dtype))
With g the output gradient, w the weight (1 when None), D the row length:
    gw = g * w
    dx = rstd * (gw − x_hat * mean(gw * x_hat))        (mean over the D entries of a row)
    dw = sum over rows of g * x_hat
so backward needs x_hat and rstd only (the LayerNorm formula without the mean terms). x_hat is saved
as in `layer_norm`: 'int8' (8-bit codes per group), 'topk' (the keep_ratio largest-magnitude
entries of each row, values in the input dtype) or 'full' (x_hat.to(x.dtype), the tensor the HF
module itself keeps for the weight gradient), plus rstd in fp32 (4 bytes per row).
NaN/Inf stay visible as in PyTorch's gradients: as in `layer_norm`, a top-k row that may have dropped
non-finite entries (a row of NaN, or more ±Inf inputs than k) makes every entry of dw NaN.
"""
from __future__ import annotations

import torch

from ..kernels.api import PrunedTensor
from ._common import (
    NORM_SAVES,
    backward_once,
    check_eps,
    check_flag,
    check_float,
    check_group_size,
    check_keep_ratio,
    check_same_device,
    compress_quantize,
    compress_topk,
    load,
    lost_nonfinite,
    no_autocast,
    restore,
    save,
)
from .layernorm import topk_keep

__all__ = ["rms_norm"]

_MODES = NORM_SAVES


def _forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float):
    """(y, x_hat fp32, rstd fp32) by the Hugging Face LlamaRMSNorm formula."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    rstd = torch.rsqrt(variance + eps)
    xhat = h * rstd
    y = xhat.to(x.dtype)
    return (y if weight is None else weight * y), xhat, rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, mode, keep_ratio, group_size, stochastic, check_finite=False):
        device_type = x.device.type
        d = x.shape[-1]
        rows = x.numel() // d
        # x_hat and rstd are kept in the input's shape (rows = every index but the last: the same groups,
        # top-k rows and bytes as on the (rows, d) view), so neither pass reshapes; a 1-D input as (1, d).
        flat = x.dim() >= 2
        with no_autocast(device_type):
            out, xhat, rstd = _forward(x, weight, eps)
            if not flat:
                xhat, rstd = xhat.reshape(rows, d), rstd.reshape(rows, 1)
            if mode == "int8":
                saved = compress_quantize(xhat, 8, group_size, stochastic, check_finite)
            elif mode == "topk":
                saved = compress_topk(xhat.to(x.dtype), topk_keep(keep_ratio, d), check_finite)
            else:
                saved = xhat.to(x.dtype)
        save(ctx, saved, rstd, weight if ctx.needs_input_grad[0] else None)
        ctx.device_type = device_type
        ctx.rows, ctx.d, ctx.flat = rows, d, flat
        ctx.x_shape, ctx.x_dtype = tuple(x.shape), x.dtype
        ctx.w_dtype = None if weight is None else weight.dtype
        return out

    @staticmethod
    @backward_once("rms_norm")
    def backward(ctx, grad_out):
        saved, rstd, weight = load(ctx)
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = grad_w = None
        rows, d = ctx.rows, ctx.d
        with no_autocast(ctx.device_type):
            g = grad_out.to(torch.float32)
            xhat = restore(saved, torch.float32)
            # In the input's shape when the rows are contiguous there (the same reductions, element for
            # element, as on the (rows, d) view); otherwise on (rows, d), as reshape gives it.
            flat = ctx.flat and g.is_contiguous()
            if not flat:
                g = g.reshape(rows, d)
                if ctx.flat:
                    xhat, rstd = xhat.reshape(rows, d), rstd.reshape(rows, 1)
            if need_x:
                # rstd * (gw - x_hat * mean(gw * x_hat)), op for op, in buffers of its own
                gw = g if weight is None else g * weight.to(torch.float32)
                t = gw * xhat
                c = t.mean(dim=-1, keepdim=True)
                t = torch.mul(xhat, c, out=t)
                dx = gw.sub_(t) if gw is not g else gw - t
                dx = dx.mul_(rstd)
                grad_x = (dx if flat else dx.view(ctx.x_shape)).to(ctx.x_dtype)
            if need_w:
                grad_w = (g * xhat).sum(tuple(range(g.dim() - 1)))
                if isinstance(saved, PrunedTensor):  # non-finite entries top-k dropped reach dw
                    grad_w = grad_w + lost_nonfinite(saved).sum()
                grad_w = grad_w.to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None, None, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    save: str = "int8",
    keep_ratio: float = 0.1,
    group_size: int = 128,
    stochastic: bool = False,
    check_finite: bool = False,
) -> torch.Tensor:
    """LlamaRMSNorm's `weight * (x * rsqrt(mean(x², -1) + eps))` (computed in fp32, cast back to
    x.dtype before the weight), bit-identical to it, saving x_hat per `save` ('int8' | 'topk' |
    'full') plus fp32 rstd per row. weight: (D,) or None. Output dtype: PyTorch's promotion of
    weight and x dtypes, as in the HF module."""
    check_float("rms_norm", "input", x)
    check_float("rms_norm", "weight", weight)
    check_same_device("rms_norm", input=x, weight=weight)
    if save not in _MODES:
        raise ValueError(f"slimfit.rms_norm: save must be one of {_MODES}, got {save!r}")
    check_keep_ratio("rms_norm", keep_ratio)
    check_group_size("rms_norm", group_size)
    check_eps("rms_norm", eps)
    check_flag("rms_norm", stochastic=stochastic, check_finite=check_finite)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"slimfit.rms_norm: input must have a non-empty last dimension, got {tuple(x.shape)}")
    if weight is not None and tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(
            f"slimfit.rms_norm: mismatched shapes: weight {tuple(weight.shape)} must be ({x.shape[-1]},) "
            f"for input {tuple(x.shape)}"
        )
    needs_graph = torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad))
    if not needs_graph:
        return _forward(x, weight, eps)[0]
    return _RMSNorm.apply(x, weight, float(eps), save, float(keep_ratio), group_size, bool(stochastic),
                          bool(check_finite))
