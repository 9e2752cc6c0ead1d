"""Linear layer whose saved activation depends on whether its weight trains.

* frozen weight (`weight.requires_grad` is False): nothing but the weight itself (a parameter,
  not an activation) is saved; backward computes only the input gradient (and the bias
  gradient when the bias trains) -- no weight-gradient GEMM. Gradients are bit-identical to
  `F.linear`'s.
* trainable weight: the input is saved in full (`input_bits=None`) or quantized to 8/4/2 bits;
  the weight gradient is computed from the dequantized input, the input and bias gradients
  are exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ._common import (
    autocast_dtype,
    backward_once,
    call_options,
    cast,
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

__all__ = ["linear", "LinearOptions"]


@dataclass(frozen=True)
class LinearOptions:
    """What a linear with a trainable weight keeps of its input: in full (`input_bits=None`) or
    quantized to 8/4/2 bits per group of `group_size` elements, rounded to nearest or stochastically
    (unbiased); `check_finite` raises on NaN/Inf in what is saved (one host read per tensor). Checked
    once, here; `linear(..., options=)` takes the object without checking it again."""

    op: ClassVar[str] = "linear"  # the op errors name
    input_bits: int | None = None
    group_size: int = 128
    stochastic: bool = False
    check_finite: bool = False

    def __post_init__(self):
        check_bits(self.op, "input_bits", self.input_bits, allow_none=True)
        check_group_size(self.op, self.group_size)
        check_flag(self.op, stochastic=self.stochastic, check_finite=self.check_finite)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, options, compute_dtype):
        device_type = x.device.type
        with no_autocast(device_type):
            xc = x.to(compute_dtype)
            out = F.linear(xc, weight.to(compute_dtype), cast(bias, compute_dtype))
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        saved_x = None
        if need_w:
            if options.input_bits is None:
                saved_x = xc
            else:
                saved_x = compress_quantize(xc, options.input_bits, options.group_size, options.stochastic,
                                            options.check_finite)
        # The weight is a parameter: saving it costs no activation memory. It is cast to the
        # compute dtype again in backward rather than saving an autocast copy of it.
        save(ctx, weight if need_x else None, saved_x)
        record_linear_meta(ctx, x, xc, weight, bias, device_type, compute_dtype)
        return out

    @staticmethod
    @backward_once("linear")
    def backward(ctx, grad_out):
        weight, saved_x = load(ctx)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        cd = ctx.compute_dtype
        grad_x = grad_w = grad_b = None
        with no_autocast(ctx.device_type):
            g = grad_out.to(cd)
            g2 = g.reshape(-1, g.shape[-1])
            if need_x:
                grad_x = input_grad(ctx, g2, weight)
            if need_w:
                x2 = restore(saved_x, cd)
                x2 = x2.reshape(-1, x2.shape[-1])
                grad_w = g2.t().mm(x2).to(ctx.w_dtype)
            if need_b:
                grad_b = g2.sum(0).to(ctx.b_dtype)
        return grad_x, grad_w, grad_b, None, None


def record_linear_meta(ctx, x, xc, weight, bias, device_type, compute_dtype) -> None:
    """The static facts a linear backward needs (read by input_grad and the weight/bias grads)."""
    ctx.device_type = device_type
    ctx.compute_dtype = compute_dtype
    ctx.x_dtype = x.dtype
    ctx.x_shape = tuple(x.shape)
    # PyTorch's mm backward returns a column-major input gradient for a column-major 2-D
    # input (mat2 @ grad^T)^T; do the same so the frozen path stays bit-identical.
    ctx.x_colmajor = xc.dim() == 2 and xc.stride(0) == 1 and xc.stride(1) == xc.shape[0]
    ctx.w_dtype = weight.dtype
    ctx.b_dtype = None if bias is None else bias.dtype


def input_grad(ctx, g2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad_x = g @ W in the layout PyTorch's mm backward gives (bit-identical), shared by
    every linear Function whose ctx records compute_dtype, x_colmajor, x_shape and x_dtype."""
    w = weight.to(ctx.compute_dtype)
    if ctx.x_colmajor:
        grad_x = w.t().mm(g2.t()).t()
    else:
        grad_x = g2.mm(w).view(ctx.x_shape)
    return grad_x.to(ctx.x_dtype)


def check_linear_shapes(op: str, x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    """weight (out, in), x (..., in), bias (out,) or None; the errors name `op` (linear, sampled_linear)."""
    if weight.dim() != 2:
        raise ValueError(
            f"slimfit.{op}: weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}"
        )
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"slimfit.{op}: mismatched shapes: input {tuple(x.shape)} has last dimension "
            f"{x.shape[-1] if x.dim() else None}, weight {tuple(weight.shape)} expects in_features={weight.shape[1]}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"slimfit.{op}: mismatched shapes: bias {tuple(bias.shape)} must be ({weight.shape[0]},)")


def linear_compute_dtype(op: str, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.dtype:
    """The autocast dtype when autocast is on, else the input's (mixed dtypes refused, as F.linear)."""
    compute_dtype = autocast_dtype(x.device.type)
    if compute_dtype is None:
        check_same_dtype(op, input=x, weight=weight, bias=bias)
        compute_dtype = x.dtype
    return compute_dtype


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    input_bits: int | None = None,
    group_size: int = 128,
    stochastic: bool = False,
    check_finite: bool = False,
    options: LinearOptions | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` that saves only what its backward needs.

    The path is chosen from `weight.requires_grad` (the scheduler's contract): frozen -> no
    activation saved and no weight-gradient GEMM; trainable -> the input saved in full
    (`input_bits=None`) or quantized per group of `group_size` elements to `input_bits`
    (8, 4 or 2) bits, with stochastic (unbiased) or nearest rounding.
    options: a LinearOptions built once (a patched module's), instead of the keywords: not checked again.
    """
    check_float("linear", "input", x)
    check_float("linear", "weight", weight)
    check_float("linear", "bias", bias)
    options = call_options(LinearOptions, options, input_bits=input_bits, group_size=group_size,
                           stochastic=stochastic, check_finite=check_finite)
    check_same_device("linear", input=x, weight=weight, bias=bias)
    check_linear_shapes("linear", x, weight, bias)
    compute_dtype = linear_compute_dtype("linear", x, weight, bias)
    needs_graph = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if not needs_graph:
        return F.linear(x, weight, bias)
    return _Linear.apply(x, weight, bias, options, compute_dtype)
