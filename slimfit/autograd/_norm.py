"""What LayerNorm and RMSNorm share: their options and how x̂ and rstd are saved and read back.

Both backward passes need only the normalized input x̂ and the per-row rstd (fp32), so both forwards hand
them to `save_normalized`, which keeps x̂ as `LayerNormOptions.save` says:
    'int8'  8-bit codes per group of `group_size` (x̂ has unit RMS per row: one scale fits)
    'topk'  the `keep_ratio` largest-magnitude entries of each row (values in the input dtype,
            int16 indices) -- the SlimFit code keeps 10% when the norm's weight is frozen
    'full'  uncompressed, in the input dtype,
and `load_normalized` gives them back, fp32, in the layout backward computes in. A top-k row that may have
dropped non-finite entries makes every entry of dw NaN, as PyTorch's dw is (`add_lost`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..kernels.api import PrunedTensor
from ._common import (
    NORM_SAVES,
    check_flag,
    check_group_size,
    check_keep_ratio,
    compress_quantize,
    compress_topk,
    load,
    lost_nonfinite,
    restore,
    save,
)

__all__ = ["LayerNormOptions", "RMSNormOptions", "topk_keep", "save_normalized", "load_normalized", "add_lost"]


@dataclass(frozen=True)
class LayerNormOptions:
    """How a norm keeps x̂ (`save`: 'int8' | 'topk' | 'full'), the share of each row top-k keeps, the
    quantization group and rounding, and the NaN/Inf check. Checked once, here. `rms_norm` takes it too
    (RMSNormOptions only names rms_norm in its errors)."""

    op: ClassVar[str] = "layer_norm"
    save: str = "int8"
    keep_ratio: float = 0.1
    group_size: int = 128
    stochastic: bool = False
    check_finite: bool = False

    def __post_init__(self):
        if self.save not in NORM_SAVES:
            raise ValueError(f"slimfit.{self.op}: save must be one of {NORM_SAVES}, got {self.save!r}")
        check_keep_ratio(self.op, self.keep_ratio)
        check_group_size(self.op, self.group_size)
        check_flag(self.op, stochastic=self.stochastic, check_finite=self.check_finite)
        object.__setattr__(self, "keep_ratio", float(self.keep_ratio))


@dataclass(frozen=True)
class RMSNormOptions(LayerNormOptions):
    """LayerNormOptions whose errors name rms_norm (the same fields, the same saving)."""

    op: ClassVar[str] = "rms_norm"


def topk_keep(keep_ratio: float, row_length: int) -> int:
    """Entries of x_hat kept per row: ceil(keep_ratio * D), at least 1 (a tiny tolerance keeps
    float noise from adding one: 0.1 * 30 = 3.0000000000000004)."""
    return min(row_length, max(1, math.ceil(keep_ratio * row_length - 1e-9)))


def save_normalized(ctx, options: LayerNormOptions, x: torch.Tensor, xhat: torch.Tensor, rstd: torch.Tensor,
                    weight, dtype: torch.dtype, d: int, flat: bool) -> None:
    """Save x̂ (fp32, compressed per `options`; 'topk' and 'full' in `dtype`) and rstd (fp32), and the weight
    when x needs a gradient; record what backward reads. d: the normalized size (> 0). `flat`: x̂ and rstd
    are kept in the input's shape (rows = every index but the last: the same groups, top-k rows and bytes
    as on the (rows, d) view); otherwise as (rows, d) and (rows, 1). Call it with autocast off."""
    rows = xhat.numel() // d
    if not flat:
        xhat, rstd = xhat.reshape(rows, d), rstd.reshape(rows, 1)
    if options.save == "int8":
        saved = compress_quantize(xhat, 8, options.group_size, options.stochastic, options.check_finite)
    elif options.save == "topk":
        saved = compress_topk(xhat.to(dtype), topk_keep(options.keep_ratio, d), options.check_finite)
    else:
        saved = xhat.to(dtype)
    save(ctx, saved, rstd, weight if ctx.needs_input_grad[0] else None)
    ctx.device_type = x.device.type
    ctx.rows, ctx.d, ctx.flat = rows, d, flat
    ctx.x_shape, ctx.x_dtype = tuple(x.shape), x.dtype
    ctx.w_dtype = None if weight is None else weight.dtype


def load_normalized(ctx, grad_out: torch.Tensor, need_xhat: bool = True):
    """(g, x̂, rstd, weight, saved, flat) for backward, g and x̂ in fp32 (x̂ None unless `need_xhat`; `saved`
    the stored x̂, for `add_lost`). In the input's shape when the rows are contiguous there (the same
    reductions, element for element, as on the (rows, d) view); otherwise on (rows, d), as reshape gives
    it (`flat` False). Call it with autocast off."""
    saved, rstd, weight = load(ctx)
    rows, d = ctx.rows, ctx.d
    g = grad_out.to(torch.float32)
    flat = ctx.flat and g.is_contiguous()
    if not flat:
        g = g.reshape(rows, d)
        if ctx.flat:
            rstd = rstd.reshape(rows, 1)
    xhat = None
    if need_xhat:
        xhat = restore(saved, torch.float32)
        if not flat and ctx.flat:
            xhat = xhat.reshape(rows, d)
    return g, xhat, rstd, weight, saved, flat


def add_lost(dw: torch.Tensor, saved) -> torch.Tensor:
    """dw, plus NaN in every entry when x̂ was saved top-k and a row may have lost non-finite entries (as
    PyTorch's dw is then); unchanged otherwise."""
    if isinstance(saved, PrunedTensor):
        return dw + lost_nonfinite(saved).sum()
    return dw
