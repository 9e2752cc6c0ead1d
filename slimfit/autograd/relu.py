"""ReLU keeping one bit per element for backward.

PyTorch's ReLU keeps its whole output for backward (threshold_backward passes the gradient where
`not y <= 0`); that one bit per element is all backward needs, so slimfit keeps it as a packed mask:
1/32 of the bytes of an fp32 output, 1/16 of a bf16 one. Forward and backward are bit-identical to
PyTorch's, NaN included (a NaN output passes its gradient through, as in PyTorch).
"""
from __future__ import annotations

import torch

from ..kernels.api import pack_bits, unpack_bits
from ._common import backward_once, check_float, load, save

__all__ = ["relu"]


class _ReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.relu(x)
        ctx.shape = tuple(x.shape)
        save(ctx, pack_bits(~(y <= 0)))  # threshold_backward's rule: NaN passes
        return y

    @staticmethod
    @backward_once("relu")
    def backward(ctx, grad):
        (packed,) = load(ctx)
        passes = unpack_bits(packed, ctx.shape)
        return torch.where(passes, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))


def relu(x: torch.Tensor) -> torch.Tensor:
    """max(x, 0), saving a 1-bit mask of the positive outputs instead of the output."""
    check_float("relu", "input", x)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return torch.relu(x)
    return _ReLU.apply(x)
