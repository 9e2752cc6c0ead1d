"""The GELU-gated product gelu(gate) * up of a GeGLU MLP (Gemma: `down(act(gate(x)) * up(x))` with a
GELU-tanh activation), saving gate and up quantized instead of the three full tensors PyTorch keeps (gate
for GELU, gelu(gate) and up for the product). Forward exact; backward at the dequantized values, as
swiglu's."""
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
    compress_quantize,
    load,
    no_autocast,
    restore,
    save,
)
from .silu import SwiGLUOptions

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


class _GeGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, options):
        with no_autocast(gate.device.type):
            out = F.gelu(gate, approximate=options.approximate) * up
        group_size, stochastic, check_finite = options.group_size, options.stochastic, options.check_finite
        saved_up = None
        if ctx.needs_input_grad[0]:
            saved_up = compress_quantize(up, options.saved_up_bits, group_size, stochastic, check_finite)
        save(ctx, compress_quantize(gate, options.bits, group_size, stochastic, check_finite), saved_up)
        ctx.device_type, ctx.up_dtype, ctx.approximate = gate.device.type, up.dtype, options.approximate
        return out

    @staticmethod
    @backward_once("geglu")
    def backward(ctx, grad_out):
        q_gate, q_up = load(ctx)
        need_gate, need_up = ctx.needs_input_grad[:2]
        grad_gate = grad_up = None
        with no_autocast(ctx.device_type):
            g = grad_out.to(torch.float32)
            gate = restore(q_gate, torch.float32)
            if need_up:
                grad_up = F.gelu(gate, approximate=ctx.approximate).mul_(g).to(ctx.up_dtype)
            if need_gate:
                gu = restore(q_up, torch.float32).mul_(g)
                grad_gate = torch.ops.aten.gelu_backward(gu, gate, approximate=ctx.approximate).to(q_gate.dtype)
        return grad_gate, grad_up, None


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
