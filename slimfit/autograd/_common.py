"""Helpers shared by the autograd functions of slimfit.

* Saving compressed activations: `save(ctx, *items)` takes tensors, `QuantizedTensor`s,
  `PrunedTensor`s and `None`s, hands every tensor to `ctx.save_for_backward` (so saved-tensor
  hooks, checkpointing and torch.compile see them) and keeps only static metadata (shapes,
  dtypes, bits, group size, row length) on ctx. `load(ctx)` rebuilds the same list in backward.
* Mixed precision: the functions decide the compute dtype themselves (`autocast_dtype`), cast
  inside forward, and run forward and backward with autocast disabled (`no_autocast`), so the
  output dtype is what PyTorch gives for the same op and a backward called inside an autocast
  region does not re-cast the gradient math.
* Argument checks whose errors name the problem (`check_float`, `check_bits`, ...).
* Options objects: each compressing Function takes one frozen dataclass of its options (what is
  saved and how: `LinearOptions`, `GELUOptions`, `LayerNormOptions`, ...), checked once in its
  `__post_init__` with the checks below. `call_options(cls, options, **keywords)` gives a public
  wrapper the object of one call: the one it was handed (built and checked once, e.g. at patch
  time; nothing is checked again), or one built from its keywords.
* Non-finite values through top-k: `lost_nonfinite(pruned)` flags the rows whose dropped entries may
  have been NaN/Inf, so a backward built on a top-k tensor can keep them visible.
* Double backward: every backward is wrapped in `backward_once(op)`; a backward run with
  `create_graph=True` raises an error naming the op instead of silently giving a wrong second
  derivative (the backward uses compressed activations and is not itself differentiable).
"""
from __future__ import annotations

import contextlib
import functools
import math
import numbers
import operator
from typing import Iterable

import torch
from torch.autograd.function import once_differentiable  # re-exported (attention.py uses it)

from ..kernels.api import PrunedTensor, QuantizedTensor, dequantize, quantize, topk_prune, topk_restore
from ..kernels.validation import FLOAT_DTYPES, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES
from .seeds import side_seed

__all__ = [
    "backward_once", "once_differentiable", "save", "load", "restore", "compress_quantize",
    "compress_topk", "autocast_dtype", "no_autocast",
    "check_float", "check_bits", "check_group_size", "check_same_dtype", "check_same_device", "check_flag",
    "check_eps", "check_keep_ratio", "lost_nonfinite", "QUANT_BITS", "call_options",
]

QUANT_BITS = SUPPORTED_BITS
NORM_SAVES = ("full", "int8", "topk")  # what a LayerNorm / RMSNorm keeps of x̂ (layer_norm, rms_norm, SlimFitConfig)

_NONE, _TENSOR, _QUANT, _PRUNED = 0, 1, 2, 3


def save(ctx, *items) -> None:
    """Save tensors / QuantizedTensor / PrunedTensor / None through ctx.save_for_backward."""
    flat: list[torch.Tensor] = []
    layout: list[tuple] = []
    for item in items:
        if item is None:
            layout.append((_NONE,))
        elif isinstance(item, QuantizedTensor):
            layout.append((_QUANT, item.meta()))
            flat.extend(item.tensors())
        elif isinstance(item, PrunedTensor):
            layout.append((_PRUNED, item.row_length))
            flat.extend((item.values, item.indices))
        elif isinstance(item, torch.Tensor):
            layout.append((_TENSOR,))
            flat.append(item)
        else:
            raise TypeError(f"slimfit: cannot save {type(item).__name__} for backward")
    ctx.save_for_backward(*flat)
    ctx.slimfit_layout = tuple(layout)


def load(ctx) -> list:
    """The items given to `save`, in order (compressed ones still compressed)."""
    flat = list(ctx.saved_tensors)
    out: list = []
    pos = 0
    for entry in ctx.slimfit_layout:
        kind = entry[0]
        if kind == _NONE:
            out.append(None)
        elif kind == _TENSOR:
            out.append(flat[pos])
            pos += 1
        elif kind == _QUANT:
            out.append(QuantizedTensor.from_parts(flat[pos:pos + 3], entry[1]))
            pos += 3
        else:
            out.append(PrunedTensor(flat[pos], flat[pos + 1], entry[1]))
            pos += 2
    return out


def _checking(check_finite: bool) -> bool:
    # The NaN/Inf check reads a value on the host (one sync per compressed tensor on a GPU), so it
    # runs only when asked (SlimFitConfig.check_finite, off by default), and never while
    # torch.compile traces (a graph break).
    return bool(check_finite) and not torch.compiler.is_compiling()


def compress_quantize(x: torch.Tensor, bits: int, group_size: int, stochastic: bool,
                      check_finite: bool = False) -> QuantizedTensor:
    """`kernels.quantize` for saving an activation (seed drawn from torch's generator)."""
    seed = side_seed("quantize", tuple(x.shape), bits) if stochastic else None  # see autograd/seeds.py
    return quantize(x, bits, group_size, stochastic, seed=seed, check_finite=_checking(check_finite))


def compress_topk(x: torch.Tensor, k: int, check_finite: bool = False) -> PrunedTensor:
    """`kernels.topk_prune` by magnitude, k entries per row of the last dimension."""
    return topk_prune(x, k=k, check_finite=_checking(check_finite))


def restore(item, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """Dense tensor from a saved item (dequantized / scattered back), optionally cast."""
    if item is None:
        return None
    if isinstance(item, QuantizedTensor):
        return dequantize(item, dtype)
    if isinstance(item, PrunedTensor):
        # cast the k kept values, not the dense row: the same tensor (zeros are zeros in every dtype),
        # without a full-size copy in the input dtype first
        if dtype is not None and item.values.dtype != dtype:
            item = PrunedTensor(item.values.to(dtype), item.indices, item.row_length)
        return topk_restore(item)
    return item if dtype is None else item.to(dtype)


def lost_nonfinite(item: PrunedTensor) -> torch.Tensor:
    """Per row of a top-k tensor (shape (..., 1), fp32): NaN where every kept value is NaN/Inf, else 0.

    Top-k by magnitude (and by value) keeps NaN and Inf first, so a row keeps all of its non-finite
    entries unless it had at least k of them; only then may some have been dropped (a LayerNorm row of
    NaN keeps k of D). A gradient summed over rows from the restored tensor (a norm's weight gradient,
    attention's dV) then misses columns that PyTorch's has non-finite; adding this flag's sum brings
    them back, arithmetically (no host read). Rows with a finite kept value lost nothing."""
    finite = item.values.isfinite().any(dim=-1, keepdim=True)
    return torch.where(finite, 0.0, float("nan"))


def backward_once(op: str):
    """Decorator for Function.backward: refuse double backward with an error naming the op."""

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if torch.is_grad_enabled():
                raise RuntimeError(
                    f"slimfit.{op}: double backward is not supported (backward was called with "
                    "create_graph=True); its backward uses compressed saved activations and is not "
                    "itself differentiable. Use the PyTorch op for higher-order gradients."
                )
            return backward(ctx, *grads)

        return wrapper

    return decorate


# ---------------------------------------------------------------- options objects
def call_options(cls: type, options, accept: type | None = None, **keywords):
    """The options object of one call of a public wrapper.

    `options` given: it is used as it is (an instance of `cls`, or of `accept` when given, was checked
    when it was built), so a patched module's forward checks nothing per call. A keyword given beside
    it must be left at its default or agree with the object, else a TypeError names the contradiction
    (a silently ignored keyword would be a wrong model). `options` None: a `cls` built from the
    keywords (they are the dataclass fields, with the same defaults), checked once in its
    `__post_init__`."""
    if options is None:
        return cls(**keywords)
    accept = cls if accept is None else accept
    if not isinstance(options, accept):
        raise TypeError(f"slimfit.{cls.op}: options must be a {accept.__name__}, got {type(options).__name__}")
    fields = accept.__dataclass_fields__  # not dataclasses.fields(cls): torch.compile traces this one
    for name, value in keywords.items():
        default, held = fields[name].default, getattr(options, name)
        if not (_same(value, default) or _same(value, held)):
            raise TypeError(f"slimfit.{cls.op}: {name}={value!r} contradicts options.{name}={held!r}; give it "
                            "in one place (options=, or the keyword without options)")
    return options


def _same(value, other) -> bool:
    """value is other, or equal to it with the same type (True is not 1, 8.0 is not 8)."""
    return value is other or (type(value) is type(other) and value == other)


# ---------------------------------------------------------------- mixed precision
def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype active for this device type, or None when autocast is off."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type autocast does not know
        return None
    return None


def no_autocast(device_type: str):
    """Context that disables autocast for the device type (a no-op where it is not on)."""
    if autocast_dtype(device_type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)


# ---------------------------------------------------------------- checks
def _is_int(v) -> bool:
    """An integer that is not a bool (True for a bit width or a group size is a mistake, not 1)."""
    if isinstance(v, bool):
        return False
    try:
        operator.index(v)
    except TypeError:
        return False
    return True


def check_float(op: str, name: str, t: torch.Tensor | None) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"slimfit.{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"slimfit.{op}: unsupported dtype {t.dtype} for {name}; use float32, float16 or "
            "bfloat16 (float64 and integer tensors are not supported)"
        )


def check_bits(op: str, name: str, bits, allowed: Iterable = QUANT_BITS, allow_none: bool = False) -> None:
    if bits is None and allow_none:
        return
    allowed = tuple(allowed)
    if not _is_int(bits) or bits not in allowed:  # 8.0 equals 8 but is not a bit width
        extra = " or None (no compression)" if allow_none else ""
        raise ValueError(f"slimfit.{op}: {name} must be one of {allowed}{extra}, got {bits!r}")


def check_group_size(op: str, group_size) -> None:
    if not _is_int(group_size) or group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(
            f"slimfit.{op}: group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size!r}"
        )


def check_same_dtype(op: str, **tensors) -> None:
    """Without autocast, PyTorch's matmul-like ops refuse mixed dtypes; so do we, by name."""
    named = [(k, v.dtype) for k, v in tensors.items() if v is not None]
    if len({d for _, d in named}) > 1:
        desc = ", ".join(f"{k}={d}" for k, d in named)
        raise TypeError(
            f"slimfit.{op}: mismatched dtypes ({desc}); cast them to one dtype or run under "
            "torch.autocast"
        )


def check_same_device(op: str, **tensors) -> None:
    """Every tensor on one device, checked before anything runs: otherwise the forward may run (a meta
    weight gives a meta output) and autograd fails later, far from the call, or PyTorch's own error
    names none of slimfit's arguments."""
    named = [(k, v.device) for k, v in tensors.items() if v is not None]
    if len({d for _, d in named}) > 1:
        desc = ", ".join(f"{k} on {d}" for k, d in named)
        raise ValueError(f"slimfit.{op}: tensors on different devices ({desc}); move them to one device")


def check_flag(op: str, **flags) -> None:
    """Boolean options must be bools: `stochastic="no"` is truthy and would silently turn rounding on."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"slimfit.{op}: {name} must be True or False, got {value!r}")


def check_eps(op: str, eps) -> None:
    """eps is added to the variance: NaN or a negative value makes rows NaN silently."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"slimfit.{op}: eps must be a finite number >= 0, got {eps!r}")


def check_keep_ratio(op: str, keep_ratio) -> None:
    """Checked whatever `save` is: a module switches to top-k when its weight is frozen."""
    if (isinstance(keep_ratio, bool) or not isinstance(keep_ratio, numbers.Real)
            or not (0.0 < keep_ratio <= 1.0)):  # NaN fails the range
        raise ValueError(f"slimfit.{op}: keep_ratio must be a number in (0, 1], got {keep_ratio!r}")


def cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)
