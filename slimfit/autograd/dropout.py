"""Dropout whose mask costs (almost) nothing to keep for backward.

    mode='seed'     the mask is a pure function of (seed, element index) (counter-based RNG), so
                    backward regenerates it: zero tensor bytes saved, the seed is a Python int.
    mode='bitmask'  the mask is saved packed, one bit per element: ceil(N / 8) bytes.

Both modes give the same output for the same seed: y = x * float32(1 / (1 - p)) where kept,
0 elsewhere (computed in fp32, cast back), with element i kept when u(seed, i) >= p. Seeds are
drawn from torch's default generator (`torch.manual_seed` makes runs repeatable) unless given.

Under torch.compile the seed is not a Python int (an int drawn with `.item()` breaks the graph,
and dynamo guards on its value: a recompile per step). `draw_seed()` then returns a 0-dim int64
tensor drawn inside the graph, and `apply_seeded_dropout` computes the same mask from it with
tensor ops (the counter-based hash of slimfit/kernels/rng.py, bit for bit), which dynamo and
Inductor trace; backward regenerates the mask from that seed, saved for backward (8 bytes), in
both modes.

Options: `DropoutOptions` (the mode), checked once when built; p and the seed are per call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..kernels import rng
from ..kernels.api import dropout_mask, pack_bits, seeded_dropout, unpack_bits
from ..kernels.reference import apply_keep
from ..kernels.validation import check_dropout_p, check_seed
from ._common import backward_once, call_options, check_flag, check_float, load, no_autocast, save
from .seeds import reset_side_seeds

__all__ = ["dropout", "draw_seed", "apply_seeded_dropout", "keep_mask", "DropoutOptions"]

_MODES = ("seed", "bitmask")


@dataclass(frozen=True)
class DropoutOptions:
    """How backward gets the mask: regenerated from the seed ('seed', 0 bytes) or saved at one bit per
    element ('bitmask'). Checked once, here."""

    op: ClassVar[str] = "dropout"
    mode: str = "seed"

    def __post_init__(self):
        if self.mode not in _MODES:
            raise ValueError(f"slimfit.dropout: mode must be 'seed' or 'bitmask', got {self.mode!r}")


def draw_seed():
    """A dropout seed from torch's default generator: a Python int in eager mode, a 0-dim int64
    tensor while torch.compile traces (no graph break, no guard on its value)."""
    if torch.compiler.is_compiling():
        return torch.randint(0, 2**62, (), dtype=torch.int64)
    return _eager_seed()


def _eager_seed() -> int:
    """A dropout seed (advances torch's generator); side seeds drawn after it count from 0 again, so
    a checkpoint's recompute, replaying from the restored generator, draws the same side seeds.

    The value of `kernels.new_seed()`, read with tolist() rather than item(): the same int from the same
    draw, without a second dispatched op (item() dispatches aten._local_scalar_dense)."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64).tolist()[0]
    reset_side_seeds()
    return seed


def apply_seeded_dropout(x: torch.Tensor, p: float, seed) -> torch.Tensor:
    """`kernels.seeded_dropout(x, p, seed)` for an int seed; the same bits from a tensor seed
    (`draw_seed()` under torch.compile), computed with traceable tensor ops."""
    if isinstance(seed, torch.Tensor):
        return _traced_seeded_dropout(x, p, seed)
    return seeded_dropout(x, p, seed)


def keep_mask(like: torch.Tensor, p: float, seed) -> torch.Tensor:
    """The bool mask of kept elements for `seed`: `kernels.dropout_mask` for an int seed, the same
    bits from tensor ops for a tensor seed (`draw_seed()` under torch.compile)."""
    if isinstance(seed, torch.Tensor):
        return _traced_keep(like, p, seed)
    return dropout_mask(like, p, seed)


def _traced_keep(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    seed = seed.to(device=x.device, dtype=torch.int64)
    # rng.seed_keys and rng.random_words, on tensors
    k0 = rng.lowbias32((seed & rng.MASK32) ^ rng.SEED_SALT0)
    k1 = rng.lowbias32((seed >> 32) ^ rng.SEED_SALT1 ^ k0)
    idx = torch.arange(x.numel(), dtype=torch.int64, device=x.device)
    words = rng.lowbias32(rng.lowbias32((idx & rng.MASK32) ^ k0) ^ (idx >> 32) ^ k1)
    u = (words >> 8).to(torch.float32) * rng.INV_2_24
    return (u >= p).view(x.shape)


def _traced_seeded_dropout(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    if p >= 1.0:
        return torch.zeros_like(x, memory_format=torch.contiguous_format)
    return apply_keep(x, _traced_keep(x, p, seed), p)


class _TracedDropout(torch.autograd.Function):
    """The compiled form: the seed is a tensor, saved for backward (8 bytes), the mask regenerated."""

    @staticmethod
    def forward(ctx, x, p, seed):
        ctx.save_for_backward(seed)
        ctx.p = p
        return _traced_seeded_dropout(x, p, seed)

    @staticmethod
    @backward_once("dropout")
    def backward(ctx, grad_out):
        (seed,) = ctx.saved_tensors
        return _traced_seeded_dropout(grad_out, ctx.p, seed), None, None


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, options, seed):
        if seed is None:
            seed = _eager_seed()
        mode = options.mode
        with no_autocast(x.device.type):
            if mode == "bitmask":
                keep = dropout_mask(x, p, seed)
                out = apply_keep(x, keep, p)
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
                grad = apply_keep(grad_out, unpack_bits(packed, ctx.shape), ctx.p)
            else:
                grad = seeded_dropout(grad_out.contiguous(), ctx.p, ctx.seed)
        return grad, None, None, None


def dropout(
    x: torch.Tensor,
    p: float = 0.5,
    training: bool = True,
    *,
    mode: str = "seed",
    seed: int | None = None,
    options: DropoutOptions | None = None,
) -> torch.Tensor:
    """Inverted dropout with probability p; the identity when not training or p == 0.
    options: a DropoutOptions built once (a patched module's), instead of `mode`."""
    check_float("dropout", "input", x)
    check_dropout_p(p)
    check_flag("dropout", training=training)
    options = call_options(DropoutOptions, options, mode=mode)
    if seed is not None:
        check_seed(seed, "dropout")
    if not training or p == 0.0:
        return x
    if torch.compiler.is_compiling():
        seed_t = draw_seed() if seed is None else torch.tensor(int(seed), dtype=torch.int64)
        if not (torch.is_grad_enabled() and x.requires_grad):
            return _traced_seeded_dropout(x, float(p), seed_t)
        return _TracedDropout.apply(x, float(p), seed_t)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return seeded_dropout(x, float(p), _eager_seed() if seed is None else int(seed))
    return _Dropout.apply(x, float(p), options, seed)
