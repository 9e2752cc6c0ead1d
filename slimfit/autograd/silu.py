"""SiLU and the SwiGLU product silu(gate) * up, saving their inputs quantized.

* `silu(x)`: forward is `F.silu(x)` exactly; x is saved as `bits`-bit codes per group. Backward is
  the exact derivative silu'(x) = s + x·s·(1 − s), s = sigmoid(x), evaluated at the dequantized
  input in fp32 (PyTorch's own `silu_backward`), cast to the input dtype.
* `swiglu(gate, up)`: forward is `F.silu(gate) * up` exactly (what LlamaMLP / MistralMLP /
  Qwen2MLP compute between their projections). Plain PyTorch saves three full tensors for it
  (gate for SiLU, silu(gate) and up for the product); this saves gate and up quantized and
  recomputes silu in backward:
      d_up   = g · silu(gate~)
      d_gate = silu_backward(g · up~, gate~)        (gate~, up~: dequantized, fp32)
  so both gradients are exact functions of the dequantized values. up is saved only when gate
  needs a gradient (d_up needs gate alone).

Backward writes its products over buffers it made itself (the dequantized inputs, silu(gate~)): the same
ops and bits as out-of-place, fewer full-size fp32 temporaries.

Options: `SiLUOptions` (bits, group size, rounding, the NaN/Inf check) and `SwiGLUOptions`, the same
plus up's bits; a SwiGLUOptions is a SiLUOptions, so one object serves a model's SiLU and its SwiGLU
products (the patch's ActivationOptions). Checked once when built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..kernels.api import QuantizedTensor
from ._common import (
    backward_once,
    call_options,
    check_bits,
    check_flag,
    check_float,
    check_group_size,
    check_same_device,
    compress_quantize,
    load,
    no_autocast,
    restore,
    save,
)

__all__ = ["silu", "swiglu", "SiLUOptions", "SwiGLUOptions"]


@dataclass(frozen=True)
class SiLUOptions:
    """SiLU's input saved as `bits`-bit (8/4/2) codes per group of `group_size`, rounded to nearest or
    stochastically; `check_finite` raises on NaN/Inf in what is saved. Checked once, here."""

    op: ClassVar[str] = "silu"
    bits: int = 4
    group_size: int = 128
    stochastic: bool = False
    check_finite: bool = False

    def __post_init__(self):
        check_bits(self.op, "bits", self.bits)
        check_group_size(self.op, self.group_size)
        check_flag(self.op, stochastic=self.stochastic, check_finite=self.check_finite)


@dataclass(frozen=True)
class SwiGLUOptions(SiLUOptions):
    """The SwiGLU product's options: gate saved at `bits`, up at `up_bits` (None: `bits`), as SiLU's."""

    op: ClassVar[str] = "swiglu"
    up_bits: int | None = None

    def __post_init__(self):
        check_bits(self.op, "bits", self.bits)
        check_bits(self.op, "up_bits", self.saved_up_bits)
        check_group_size(self.op, self.group_size)
        check_flag(self.op, stochastic=self.stochastic, check_finite=self.check_finite)

    @property
    def saved_up_bits(self) -> int:
        """The bits up is saved at."""
        return self.bits if self.up_bits is None else self.up_bits


class _SiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, options):
        with no_autocast(x.device.type):
            out = F.silu(x)
        save(ctx, compress_quantize(x, options.bits, options.group_size, options.stochastic, options.check_finite))
        ctx.device_type = x.device.type
        return out

    @staticmethod
    @backward_once("silu")
    def backward(ctx, grad_out):
        (q,) = load(ctx)
        with no_autocast(ctx.device_type):
            x = restore(q, torch.float32)  # a fresh buffer: the gradient is written over it
            grad = torch.ops.aten.silu_backward.grad_input(grad_out.to(torch.float32), x, grad_input=x)
        return grad.to(q.dtype), None


def _activate(x: torch.Tensor, approximate: str | None) -> torch.Tensor:
    """The gate's activation: SiLU (approximate None) or GELU ('none' | 'tanh')."""
    return F.silu(x) if approximate is None else F.gelu(x, approximate=approximate)


def _activation_backward(gu: torch.Tensor, x: torch.Tensor, approximate: str | None) -> torch.Tensor:
    """d activation(x) times gu, written over gu."""
    if approximate is None:
        return torch.ops.aten.silu_backward.grad_input(gu, x, grad_input=gu)
    return torch.ops.aten.gelu_backward.grad_input(gu, x, approximate=approximate, grad_input=gu)


class _GatedProduct(torch.autograd.Function):
    """activation(gate) * up saving gate and up quantized; the activation is SiLU, or GELU when the options
    carry an `approximate` (geglu.GeGLUOptions). Subclasses add the backward under their op's name."""

    @staticmethod
    def forward(ctx, gate, up, options):
        approximate = getattr(options, "approximate", None)
        with no_autocast(gate.device.type):
            out = _activate(gate, approximate) * up
        need_gate = ctx.needs_input_grad[0]
        group_size, stochastic, check_finite = options.group_size, options.stochastic, options.check_finite
        saved_up = None
        if need_gate:
            saved_up = compress_quantize(up, options.saved_up_bits, group_size, stochastic, check_finite)
        save(ctx, compress_quantize(gate, options.bits, group_size, stochastic, check_finite), saved_up)
        ctx.device_type, ctx.up_dtype, ctx.approximate = gate.device.type, up.dtype, approximate
        return out

    @staticmethod
    def gated_backward(ctx, grad_out):
        q_gate, q_up = load(ctx)
        need_gate, need_up = ctx.needs_input_grad[:2]
        with no_autocast(ctx.device_type):
            if not _in_blocks(q_gate, q_up, grad_out):
                return (*_gated_grads(q_gate, q_up, grad_out, need_gate, need_up, ctx), None)
            # A block of elements at a time: the fp32 temporaries (g, gate~, up~ and their products) are a
            # block's, not the tensor's (a bf16 Qwen2.5-0.5B layer at b1 s1024: three 19 MiB fp32 tensors);
            # only the two gradients are full-size, in their own dtypes. Every op is elementwise and every block
            # starts a group (a multiple of 128 elements), so each element's bits are the whole tensor's.
            n = grad_out.numel()
            grad_gate = torch.empty(grad_out.shape, dtype=q_gate.dtype, device=grad_out.device) if need_gate else None
            grad_up = torch.empty(grad_out.shape, dtype=ctx.up_dtype, device=grad_out.device) if need_up else None
            flat_g = grad_out.reshape(-1)
            step = max(q_gate.group_size, GATED_BLOCK_ELEMENTS // q_gate.group_size * q_gate.group_size)
            for start in range(0, n, step):
                end = min(n, start + step)
                part_up = None if q_up is None else q_up.elements(start, end)
                d_gate, d_up = _gated_grads(q_gate.elements(start, end), part_up, flat_g[start:end], need_gate,
                                            need_up, ctx)
                if need_gate:
                    grad_gate.view(-1)[start:end].copy_(d_gate)
                if need_up:
                    grad_up.view(-1)[start:end].copy_(d_up)
        return grad_gate, grad_up, None


# Elements of a block of the gated product's backward: its fp32 temporaries 4 MiB each. One size on every device,
# so a plan on fake CPU tensors holds a CUDA step's blocks (about eight launches a block: Llama-3.1-8B at b2 s2048
# makes 56 blocks a layer).
GATED_BLOCK_ELEMENTS = 2**20


def _in_blocks(q_gate, q_up, grad_out: torch.Tensor) -> bool:
    """Whether the backward runs in blocks: a tensor above one block, a contiguous gradient (a strided one keeps
    its layout through the product, below), and both inputs quantized in logical order."""
    quantized = [q for q in (q_gate, q_up) if q is not None]
    return grad_out.numel() > GATED_BLOCK_ELEMENTS and grad_out.is_contiguous() and all(
        isinstance(q, QuantizedTensor) and q.storage_dims is None for q in quantized)


def _gated_grads(q_gate, q_up, grad_out: torch.Tensor, need_gate: bool, need_up: bool, ctx):
    """(d_gate, d_up) of activation(gate) * up at the dequantized inputs, in their dtypes (None where not needed)."""
    grad_gate = grad_up = None
    # the dequantized gate and up are fresh buffers; each product is written over its second factor
    # (multiplication commutes bit for bit), and d_gate over g·up~. A strided g keeps the product g * up~ in its
    # layout (silu_backward's vectorized and scalar loops differ in the last bit, and the layout picks the loop)
    g = grad_out.to(torch.float32)
    gate = restore(q_gate, torch.float32)
    if need_up:
        grad_up = _activate(gate, ctx.approximate).mul_(g).to(ctx.up_dtype)
    if need_gate:
        up = restore(q_up, torch.float32)
        gu = up.mul_(g) if g.is_contiguous() else g * up
        grad_gate = _activation_backward(gu, gate, ctx.approximate).to(q_gate.dtype)
    return grad_gate, grad_up


class _SwiGLU(_GatedProduct):
    @staticmethod
    @backward_once("swiglu")
    def backward(ctx, grad_out):
        return _GatedProduct.gated_backward(ctx, grad_out)


def silu(x: torch.Tensor, *, bits: int = 4, group_size: int = 128, stochastic: bool = False,
         check_finite: bool = False, options: SiLUOptions | None = None) -> torch.Tensor:
    """`F.silu(x)` saving x as `bits`-bit (8/4/2) codes per group of `group_size`.
    options: a SiLUOptions (or SwiGLUOptions) built once, instead of the keywords: not checked again.

    Output dtype = input dtype (SiLU is not cast by autocast, as in PyTorch)."""
    check_float("silu", "input", x)
    options = call_options(SiLUOptions, options, bits=bits, group_size=group_size, stochastic=stochastic,
                           check_finite=check_finite)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return F.silu(x)
    return _SiLU.apply(x, options)


def swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    bits: int = 4,
    up_bits: int | None = None,
    group_size: int = 128,
    stochastic: bool = False,
    check_finite: bool = False,
    options: SwiGLUOptions | None = None,
) -> torch.Tensor:
    """`F.silu(gate) * up` saving gate at `bits` and up at `up_bits` (default: `bits`) bits per
    element, per group of `group_size`; backward recomputes silu at the dequantized gate.
    options: a SwiGLUOptions built once (a patched MLP's), instead of the keywords: not checked again.

    gate and up must have the same shape (the two projections of a SwiGLU MLP). Output dtype:
    PyTorch's type promotion of the two (the same dtype in a model)."""
    check_float("swiglu", "gate", gate)
    check_float("swiglu", "up", up)
    options = call_options(SwiGLUOptions, options, bits=bits, up_bits=up_bits, group_size=group_size,
                           stochastic=stochastic, check_finite=check_finite)
    check_same_device("swiglu", gate=gate, up=up)
    if tuple(gate.shape) != tuple(up.shape):
        raise ValueError(
            f"slimfit.swiglu: mismatched shapes: gate {tuple(gate.shape)} and up {tuple(up.shape)} must be equal"
        )
    if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
        return F.silu(gate) * up
    return _SwiGLU.apply(gate, up, options)
