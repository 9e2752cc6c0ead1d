"""GELU that saves its input quantized to 4 (or 8, 2) bits.

The forward is exact (`F.gelu`). Backward evaluates the exact derivative of the chosen form
(erf, or the tanh approximation) at the dequantized input, in fp32, through PyTorch's own
`gelu_backward`, and casts the gradient to the input dtype. The dequantized input is the only full-size
fp32 buffer backward makes: the gradient is written over it (elementwise, each element read before it is
written), so an fp32 model's backward allocates one tensor, the gradient it returns.

Options: `GELUOptions` (bits, the formula, the group size, rounding, the NaN/Inf check), checked once
when built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ._common import (
    backward_once,
    call_options,
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

__all__ = ["gelu", "GELUOptions"]

_APPROX = ("none", "tanh", "quick")  # quick: x * sigmoid(1.702 x) (QuickGELU: CLIP)
_QUICK = 1.702


@dataclass(frozen=True)
class GELUOptions:
    """A GELU's options: its input saved as `bits`-bit (8/4/2) codes per group of `group_size`,
    rounded to nearest or stochastically; `approximate` the formula ('none': erf, 'tanh', 'quick': QuickGELU's
    x * sigmoid(1.702 x)); `check_finite`
    raises on NaN/Inf in what is saved. Checked once, here."""

    op: ClassVar[str] = "gelu"
    bits: int = 4
    approximate: str = "none"
    group_size: int = 128
    stochastic: bool = False
    check_finite: bool = False

    def __post_init__(self):
        check_bits(self.op, "bits", self.bits)
        check_group_size(self.op, self.group_size)
        check_flag(self.op, stochastic=self.stochastic, check_finite=self.check_finite)
        if self.approximate not in _APPROX:
            raise ValueError(f"slimfit.{self.op}: approximate must be 'none', 'tanh' or 'quick', got "
                             f"{self.approximate!r}")


class _GELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, options):
        with no_autocast(x.device.type):
            out = _forward(x, options.approximate)
        save(ctx, compress_quantize(x, options.bits, options.group_size, options.stochastic, options.check_finite))
        ctx.approximate = options.approximate
        ctx.device_type = x.device.type
        return out

    @staticmethod
    @backward_once("gelu")
    def backward(ctx, grad_out):
        (q,) = load(ctx)
        with no_autocast(ctx.device_type):
            x = restore(q, torch.float32)  # a fresh buffer: the gradient is written over it
            if ctx.approximate == "quick":  # d/dx x·s(ax) = s + a·x·s·(1 - s), s = sigmoid(a·x)
                s = torch.sigmoid(_QUICK * x)
                grad = grad_out.to(torch.float32) * (s + _QUICK * x * s * (1.0 - s))
            else:
                grad = torch.ops.aten.gelu_backward.grad_input(grad_out.to(torch.float32), x,
                                                               approximate=ctx.approximate, grad_input=x)
        return grad.to(q.dtype), None


def _forward(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """The GELU the module computes, op for op (QuickGELU as transformers writes it)."""
    if approximate == "quick":
        return x * torch.sigmoid(_QUICK * x)
    return F.gelu(x, approximate=approximate)


def gelu(
    x: torch.Tensor,
    *,
    bits: int = 4,
    approximate: str = "none",
    group_size: int = 128,
    stochastic: bool = False,
    check_finite: bool = False,
    options: GELUOptions | None = None,
) -> torch.Tensor:
    """`F.gelu(x, approximate=...)` saving x as `bits`-bit codes per group of `group_size`.
    options: a GELUOptions built once (a patched module's), instead of the keywords: not checked again.

    Output dtype = input dtype (GELU is not cast by autocast, as in PyTorch)."""
    check_float("gelu", "input", x)
    options = call_options(GELUOptions, options, bits=bits, approximate=approximate, group_size=group_size,
                           stochastic=stochastic, check_finite=check_finite)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return _forward(x, options.approximate)
    return _GELU.apply(x, options)
