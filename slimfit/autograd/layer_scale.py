"""A per-channel scale x * w (LayerScale: DINOv2, ConvNeXt, CaiT ...) keeping x quantized for w's gradient.

PyTorch keeps x in full for the scale's gradient (w trains every step: a 1-D parameter is never scheduled).
Here x is saved as `bits`-bit codes: grad_x = g * w is exact, grad_w = sum over the leading dimensions of
g * x~ at the dequantized x (a reduction over every token, where rounding errors average out). A frozen w
saves nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ._common import (
    backward_once,
    call_options,
    check_float,
    check_same_device,
    compress_quantize,
    load,
    restore,
    save,
)
from .silu import SiLUOptions

__all__ = ["layer_scale", "LayerScaleOptions"]


@dataclass(frozen=True)
class LayerScaleOptions(SiLUOptions):
    """x saved at `bits` (8/4/2) per group of `group_size` for the scale's gradient: SiLU's saving options
    (checked once, there), 8 bits by default."""

    op: ClassVar[str] = "layer_scale"
    bits: int = 8


class _LayerScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, options):
        out = x * weight
        saved_x = None
        if ctx.needs_input_grad[1]:
            saved_x = compress_quantize(x, options.bits, options.group_size, options.stochastic,
                                        options.check_finite)
        save(ctx, saved_x, weight if ctx.needs_input_grad[0] else None)
        ctx.weight_dtype = weight.dtype
        return out

    @staticmethod
    @backward_once("layer_scale")
    def backward(ctx, grad_out):
        saved_x, weight = load(ctx)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out * weight
        if ctx.needs_input_grad[1]:
            x = restore(saved_x, torch.float32)
            grad_w = (grad_out.to(torch.float32) * x).reshape(-1, x.shape[-1]).sum(0).to(ctx.weight_dtype)
        return grad_x, grad_w, None


def layer_scale(x: torch.Tensor, weight: torch.Tensor, *, bits: int = 8, group_size: int = 128,
                stochastic: bool = False, check_finite: bool = False,
                options: LayerScaleOptions | None = None) -> torch.Tensor:
    """`x * weight` (weight: one value per channel of x's last dimension), saving x quantized for the
    weight's gradient. options: a LayerScaleOptions built once, instead of the keywords."""
    check_float("layer_scale", "input", x)
    check_float("layer_scale", "weight", weight)
    check_same_device("layer_scale", input=x, weight=weight)
    options = call_options(LayerScaleOptions, options, bits=bits, group_size=group_size, stochastic=stochastic,
                           check_finite=check_finite)
    if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"slimfit.layer_scale: weight must be 1-D with x's last dimension, got weight "
                         f"{tuple(weight.shape)} for x {tuple(x.shape)}")
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return x * weight
    return _LayerScale.apply(x, weight, options)
