"""The GELU-gated product gelu(gate) * up of a GeGLU MLP (Gemma: `down(act(gate(x)) * up(x))` with a
GELU-tanh activation), saving gate and up quantized instead of the three full tensors PyTorch keeps (gate
for GELU, gelu(gate) and up for the product). The same gated-product Function as swiglu's
(silu._GatedProduct), with GELU as the activation."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ._common import (
    backward_once,
    call_options,
    check_float,
    check_same_device,
)
from .silu import SwiGLUOptions, _GatedProduct

__all__ = ["geglu", "GeGLUOptions"]
APPROXIMATIONS = ("none", "tanh")


@dataclass(frozen=True)
class GeGLUOptions(SwiGLUOptions):
    """SwiGLU's options with the GELU's approximation ('none' or 'tanh'), checked once."""

    op: ClassVar[str] = "geglu"
    approximate: str = "tanh"

    def __post_init__(self):
        super().__post_init__()
        if self.approximate not in APPROXIMATIONS:
            raise ValueError(f"slimfit.geglu: approximate must be one of {APPROXIMATIONS}, got {self.approximate!r}")


class _GeGLU(_GatedProduct):
    @staticmethod
    @backward_once("geglu")
    def backward(ctx, grad_out):
        return _GatedProduct.gated_backward(ctx, grad_out)


def geglu(gate: torch.Tensor, up: torch.Tensor, *, approximate: str = "tanh", bits: int = 4,
          up_bits: int | None = None, group_size: int = 128, stochastic: bool = False, check_finite: bool = False,
          options: GeGLUOptions | None = None) -> torch.Tensor:
    """`F.gelu(gate, approximate) * up` saving gate at `bits` and up at `up_bits` (default `bits`) bits per
    element; backward recomputes the GELU at the dequantized gate. options: a GeGLUOptions built once."""
    check_float("geglu", "gate", gate)
    check_float("geglu", "up", up)
    options = call_options(GeGLUOptions, options, approximate=approximate, bits=bits, up_bits=up_bits,
                           group_size=group_size, stochastic=stochastic, check_finite=check_finite)
    check_same_device("geglu", gate=gate, up=up)
    if tuple(gate.shape) != tuple(up.shape):
        raise ValueError(f"slimfit.geglu: mismatched shapes: gate {tuple(gate.shape)} and up {tuple(up.shape)} "
                         "must be equal")
    if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
        return F.gelu(gate, approximate=options.approximate) * up
    return _GeGLU.apply(gate, up, options)
