"""Dropout whose mask costs (almost) nothing to keep for backward.

    mode='seed'     the mask is a pure function of (seed, element index) (counter-based RNG), so
                    backward regenerates it: zero tensor bytes saved, the seed is a Python int.
    mode='bitmask'  the mask is saved packed, one bit per element: ceil(N / 8) bytes.

Both modes give the same output for the same seed: y = x * float32(1 / (1 - p)) where kept,
0 elsewhere (computed in fp32, cast back), with element i kept when u(seed, i) >= p. Seeds are
drawn from torch's default generator (`torch.manual_seed` makes runs repeatable) unless given.
"""
from __future__ import annotations

import torch

from ..kernels.api import dropout_mask, new_seed, pack_bits, seeded_dropout, unpack_bits
from ..kernels.validation import check_dropout_p, check_seed
from ._common import backward_once, check_float, load, no_autocast, save

__all__ = ["dropout"]

_MODES = ("seed", "bitmask")


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, mode, seed):
        if seed is None:
            seed = new_seed()
        with no_autocast(x.device.type):
            if mode == "bitmask":
                keep = dropout_mask(x, p, seed)
                out = _apply_mask(x, keep, p)
                save(ctx, pack_bits(keep))
            else:
                out = seeded_dropout(x, p, seed)
                save(ctx)
        ctx.p, ctx.mode, ctx.seed = p, mode, seed
        ctx.shape = tuple(x.shape)
        ctx.device_type = x.device.type
        return out

    @staticmethod
    @backward_once("dropout")
    def backward(ctx, grad_out):
        with no_autocast(ctx.device_type):
            if ctx.mode == "bitmask":
                (packed,) = load(ctx)
                grad = _apply_mask(grad_out, unpack_bits(packed, ctx.shape), ctx.p)
            else:
                grad = seeded_dropout(grad_out.contiguous(), ctx.p, ctx.seed)
        return grad, None, None, None


def _apply_mask(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """The formula of seeded_dropout with an explicit mask (same bits)."""
    if p >= 1.0:
        return torch.zeros_like(x, memory_format=torch.contiguous_format)
    factor = torch.tensor(1.0 / (1.0 - p), dtype=torch.float32)
    y = x.to(torch.float32) * factor
    return torch.where(keep, y, torch.zeros((), dtype=torch.float32)).to(x.dtype)


def dropout(
    x: torch.Tensor,
    p: float = 0.5,
    training: bool = True,
    *,
    mode: str = "seed",
    seed: int | None = None,
) -> torch.Tensor:
    """Inverted dropout with probability p; the identity when not training or p == 0."""
    check_float("dropout", "input", x)
    check_dropout_p(p)
    if mode not in _MODES:
        raise ValueError(f"slimfit.dropout: mode must be 'seed' or 'bitmask', got {mode!r}")
    if seed is not None:
        check_seed(seed, "dropout")
    if not training or p == 0.0:
        return x
    if not (torch.is_grad_enabled() and x.requires_grad):
        return seeded_dropout(x, float(p), new_seed() if seed is None else int(seed))
    return _Dropout.apply(x, float(p), mode, seed)
