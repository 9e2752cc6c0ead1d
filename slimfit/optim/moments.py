"""Which entries of a parameter's optimizer state may be compressed or offloaded, and how.

Compression is lossy, so it is limited to state entries whose meaning is known: a first moment (a running
mean of gradients, quantized as is) or a second moment (a running mean or sum of squared gradients,
quantized through its square root: see codec.py). Entries of any other name (an optimizer slimfit does not
know) stay resident in full. Offloading is lossless, so it moves every plain dense tensor of the
parameter's shape whatever its name (AdamW's moments, bitsandbytes' 8-bit ``state1``/``state2``).
Left alone always: scalars such as ``step``, tensors of another shape (bitsandbytes' ``qmap``/``absmax``)
and tensor subclasses (torchao's ``OptimState8bit``, already 8-bit and not a plain storage), except FSDP2's
DTensors sharded as their parameter is, whose rank-local pieces are held (sharded_params.py).
"""
from __future__ import annotations

import torch

__all__ = ["FIRST_MOMENTS", "SECOND_MOMENTS", "compress_transform", "offloadable", "plain_tensor"]

# torch.optim: Adam/AdamW/NAdam/RAdam/Adamax "exp_avg", SGD "momentum_buffer", RMSprop "grad_avg" (centered).
FIRST_MOMENTS = frozenset({"exp_avg", "momentum_buffer", "grad_avg"})
# Adam/AdamW "exp_avg_sq" (and amsgrad's "max_exp_avg_sq"), RMSprop "square_avg", Adagrad "sum",
# Adadelta "square_avg" / "acc_delta": all non-negative running means or sums of squares.
SECOND_MOMENTS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta"})
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def plain_tensor(t) -> bool:
    """A plain tensor: torch.Tensor itself, or the fake tensor standing for one (slimfit.plan's prediction)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return type(t) is torch.Tensor or type(t) is FakeTensor


def _dense_like(t, p: torch.Tensor) -> bool:
    if _same_sharding(t, p):   # FSDP2: the state is sharded as its parameter is; its local piece is what is held
        from .sharded_params import local

        t, p = local(t), local(p)
    return plain_tensor(t) and t.shape == p.shape and t.dim() > 0 and t.device == p.device


def _same_sharding(t, p: torch.Tensor) -> bool:
    from .sharded_params import is_dtensor

    return (is_dtensor(t) and is_dtensor(p) and t.device_mesh == p.device_mesh and t.placements == p.placements
            and t.shape == p.shape)


def compress_transform(key, t, p: torch.Tensor) -> bool | None:
    """None: leave ``t`` (the entry ``key`` of ``p``'s state) as it is; False: quantize it linearly;
    True: quantize its square root (a second moment)."""
    if not isinstance(key, str) or not _dense_like(t, p) or t.dtype not in _FLOATS:
        return None
    if key in SECOND_MOMENTS:
        return True
    if key in FIRST_MOMENTS:
        return False
    return None


def offloadable(key, t, p: torch.Tensor) -> bool:
    """True when the entry ``key`` of ``p``'s state is a plain dense tensor of ``p``'s shape on its device."""
    return isinstance(key, str) and _dense_like(t, p)
