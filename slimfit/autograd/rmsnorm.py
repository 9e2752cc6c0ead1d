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
by the helper `layer_norm` uses (`_norm.save_normalized`), as its options say: 'int8' (8-bit codes per
group), 'topk' (the keep_ratio largest-magnitude entries of each row, values in the input dtype) or
'full' (x_hat.to(x.dtype), the tensor the HF module itself keeps for the weight gradient), plus rstd in
fp32 (4 bytes per row). Options: `RMSNormOptions` (or a LayerNormOptions: the same fields), checked once.
NaN/Inf stay visible as in PyTorch's gradients: as in `layer_norm`, a top-k row that may have dropped
non-finite entries (a row of NaN, or more ±Inf inputs than k) makes every entry of dw NaN.
"""
from __future__ import annotations

import torch

from ._common import (
    backward_once,
    call_options,
    check_eps,
    check_float,
    check_same_device,
    no_autocast,
)
from ._norm import LayerNormOptions, RMSNormOptions, add_lost, load_normalized, save_normalized

__all__ = ["rms_norm", "RMSNormOptions"]


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
    def forward(ctx, x, weight, eps, options):
        with no_autocast(x.device.type):
            out, xhat, rstd = _forward(x, weight, eps)
            # x_hat and rstd in the input's shape (no reshape in either pass); a 1-D input as (1, d)
            save_normalized(ctx, options, x, xhat, rstd, weight, x.dtype, x.shape[-1], x.dim() >= 2)
        return out

    @staticmethod
    @backward_once("rms_norm")
    def backward(ctx, grad_out):
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = grad_w = None
        with no_autocast(ctx.device_type):
            # in the input's shape when the rows are contiguous there, else on (rows, d) (`flat` False)
            g, xhat, rstd, weight, saved, flat = load_normalized(ctx, grad_out)
            if need_x:
                # rstd * (gw - x_hat * mean(gw * x_hat)), op for op, in buffers of its own
                gw = g if weight is None else g * weight.to(torch.float32)
                t = gw * xhat
                c = t.mean(dim=-1, keepdim=True)
                t = torch.mul(xhat, c, out=t)
                dx = gw.sub_(t) if gw is not g else gw - t
                dx = dx.mul_(rstd)
                grad_x = (dx if flat else dx.view(ctx.x_shape)).to(ctx.x_dtype)
            if need_w:  # non-finite entries top-k dropped reach dw
                grad_w = add_lost((g * xhat).sum(tuple(range(g.dim() - 1))), saved).to(ctx.w_dtype)
        return grad_x, grad_w, None, None


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
    options: LayerNormOptions | None = None,
) -> torch.Tensor:
    """LlamaRMSNorm's `weight * (x * rsqrt(mean(x², -1) + eps))` (computed in fp32, cast back to
    x.dtype before the weight), bit-identical to it, saving x_hat per `save` ('int8' | 'topk' |
    'full') plus fp32 rstd per row. weight: (D,) or None. Output dtype: PyTorch's promotion of
    weight and x dtypes, as in the HF module.
    options: an RMSNormOptions (or LayerNormOptions) built once (a patched module's), instead of save,
    keep_ratio, group_size, stochastic and check_finite: not checked again."""
    check_float("rms_norm", "input", x)
    check_float("rms_norm", "weight", weight)
    check_same_device("rms_norm", input=x, weight=weight)
    # given, any LayerNormOptions: the two norms save x̂ alike (RMSNormOptions only names rms_norm in errors)
    options = call_options(RMSNormOptions, options, LayerNormOptions, save=save, keep_ratio=keep_ratio,
                           group_size=group_size, stochastic=stochastic, check_finite=check_finite)
    check_eps("rms_norm", eps)
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
    return _RMSNorm.apply(x, weight, float(eps), options)

