"""Convolution with a frozen fast path (ViT / DeiT / DINOv2 patch embedding, frozen CNN layers).

PyTorch's convolution backward is one formula for the input, weight and bias gradients, so autograd
keeps the input whenever anything needs a gradient -- a frozen patch embedding with a trainable bias
still keeps the whole batch of pixel values. With a frozen weight the input gradient needs only the
weight (a parameter, not an activation) and the bias gradient needs only the output gradient, so:

* weight frozen: nothing but the weight is saved (and not even the weight when the input needs no
  gradient, which is the pixel-values case): **0 activation bytes**. Backward calls
  `aten.convolution_backward` with the weight-gradient output masked off, as PyTorch's own backward
  does for the input and bias gradients, so the gradients are bit-identical to `F.conv{1,2,3}d`'s.
* weight trainable (or no graph): plain `F.conv{1,2,3}d`, PyTorch's behaviour.

Autocast: the compute dtype is the autocast dtype (convolutions are in autocast's lower-precision
list on CPU and CUDA), cast inside forward; backward recasts the weight from the parameter instead of
keeping the autocast copy PyTorch keeps.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import (
    autocast_dtype,
    backward_once,
    cast,
    check_float,
    check_same_device,
    check_same_dtype,
    load,
    no_autocast,
    save,
)

__all__ = ["conv"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _tuple(value, n: int, name: str) -> tuple:
    if isinstance(value, int):
        return (value,) * n
    value = tuple(value)
    if len(value) != n or not all(isinstance(v, int) for v in value):
        raise ValueError(f"slimfit.conv: {name} must be an int or {n} ints, got {value!r}")
    return value


class _FrozenConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, geometry, compute_dtype):
        """geometry: (stride, padding, dilation, groups), the tuples already expanded to the dimension."""
        n = weight.dim() - 2
        with no_autocast(x.device.type):
            out = _CONV[n](x.to(compute_dtype), weight.to(compute_dtype), cast(bias, compute_dtype), *geometry)
        save(ctx, weight if ctx.needs_input_grad[0] else None)
        ctx.conv = geometry
        ctx.device_type = x.device.type
        ctx.compute_dtype = compute_dtype
        ctx.x_shape, ctx.x_dtype = tuple(x.shape), x.dtype
        ctx.w_shape = tuple(weight.shape)
        ctx.b_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    @backward_once("conv")
    def backward(ctx, grad_out):
        (weight,) = load(ctx)
        need_x, _, need_b = ctx.needs_input_grad[:3]
        stride, padding, dilation, groups = ctx.conv
        cd = ctx.compute_dtype
        grad_x = grad_b = None
        with no_autocast(ctx.device_type):
            g = grad_out.to(cd)
            # convolution_backward reads only the shapes of the operands it does not differentiate
            # through (torch.nn.grad.conv2d_input passes the same kind of stand-in for the input)
            x_like = g.new_empty(1).expand(ctx.x_shape)
            w = weight.to(cd) if weight is not None else g.new_empty(1).expand(ctx.w_shape)
            bias_sizes = [ctx.w_shape[0]] if need_b else None
            gx, _, gb = torch.ops.aten.convolution_backward(
                g, x_like, w, bias_sizes, list(stride), list(padding), list(dilation), False,
                [0] * len(stride), groups, [need_x, False, need_b])
            if need_x:
                grad_x = gx.to(ctx.x_dtype)
            if need_b:
                grad_b = gb.to(ctx.b_dtype)
        return grad_x, None, grad_b, None, None


def conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride=1,
    padding=0,
    dilation=1,
    groups: int = 1,
) -> torch.Tensor:
    """`F.conv{1,2,3}d(x, weight, bias, stride, padding, dilation, groups)` (the dimension from
    weight.dim()) that saves no activation when the weight is frozen; numeric padding only
    (zeros padding mode; nn.Conv's 'same'/'valid' strings are resolved by the caller)."""
    check_float("conv", "input", x)
    check_float("conv", "weight", weight)
    check_float("conv", "bias", bias)
    check_same_device("conv", input=x, weight=weight, bias=bias)
    n = weight.dim() - 2
    if n not in _CONV:
        raise ValueError(f"slimfit.conv: weight must be 3-, 4- or 5-D (a 1/2/3-d convolution), "
                         f"got {tuple(weight.shape)}")
    stride, padding, dilation = (_tuple(v, n, name) for v, name in
                                 ((stride, "stride"), (padding, "padding"), (dilation, "dilation")))
    needs_graph = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if not needs_graph or weight.requires_grad or x.dim() != n + 2:  # trainable, or an unbatched input
        return _CONV[n](x, weight, bias, stride, padding, dilation, groups)
    compute_dtype = autocast_dtype(x.device.type)
    if compute_dtype is None:
        check_same_dtype("conv", input=x, weight=weight, bias=bias)
        compute_dtype = x.dtype
    return _FrozenConv.apply(x, weight, bias, (stride, padding, dilation, groups), compute_dtype)
