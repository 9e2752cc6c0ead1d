"""GELU that saves its input quantized to 4 (or 8, 2) bits.

The forward is exact (`F.gelu`). Backward evaluates the exact derivative of the chosen form
(erf, or the tanh approximation) at the dequantized input, in fp32, through PyTorch's own
`gelu_backward`, and casts the gradient to the input dtype. The dequantized input is the only full-size
fp32 buffer backward makes: the gradient is written over it (elementwise, each element read before it is
written), so an fp32 model's backward allocates one tensor, the gradient it returns.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import (
    backward_once,
    check_bits,
    check_flag,
    check_float,
    check_group_size,
    compress_quantize,
    load,
    no_autocast,
    restore,
    save,
)

__all__ = ["gelu"]

_APPROX = ("none", "tanh")


class _GELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bits, approximate, group_size, stochastic, check_finite=False):
        with no_autocast(x.device.type):
            out = F.gelu(x, approximate=approximate)
        save(ctx, compress_quantize(x, bits, group_size, stochastic, check_finite))
        ctx.approximate = approximate
        ctx.device_type = x.device.type
        return out

    @staticmethod
    @backward_once("gelu")
    def backward(ctx, grad_out):
        (q,) = load(ctx)
        with no_autocast(ctx.device_type):
            x = restore(q, torch.float32)  # a fresh buffer: the gradient is written over it
            grad = torch.ops.aten.gelu_backward.grad_input(grad_out.to(torch.float32), x, approximate=ctx.approximate,
                                                           grad_input=x)
        return grad.to(q.dtype), None, None, None, None, None


def gelu(
    x: torch.Tensor,
    *,
    bits: int = 4,
    approximate: str = "none",
    group_size: int = 128,
    stochastic: bool = False,
    check_finite: bool = False,
) -> torch.Tensor:
    """`F.gelu(x, approximate=...)` saving x as `bits`-bit codes per group of `group_size`.

    Output dtype = input dtype (GELU is not cast by autocast, as in PyTorch)."""
    check_float("gelu", "input", x)
    check_bits("gelu", "bits", bits)
    check_group_size("gelu", group_size)
    check_flag("gelu", stochastic=stochastic, check_finite=check_finite)
    if approximate not in _APPROX:
        raise ValueError(f"slimfit.gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    if not (torch.is_grad_enabled() and x.requires_grad):
        return F.gelu(x, approximate=approximate)
    return _GELU.apply(x, bits, approximate, group_size, bool(stochastic), bool(check_finite))
