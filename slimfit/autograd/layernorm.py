"""LayerNorm that saves only the normalized output x_hat (compressed) and the per-row rstd.

With g the output gradient, w the weight (1 when None), D the normalized size:
    gw = g * w
    dx = rstd * (gw - mean(gw) - x_hat * mean(gw * x_hat))       (means over the D entries of a row)
    dw = sum over rows of g * x_hat,   db = sum over rows of g
so backward needs x_hat and rstd only. x_hat is saved as `LayerNormOptions.save` says ('int8', 'topk' or
'full'), by the helper RMSNorm shares (`_norm.save_normalized`; the formats are described there).
NaN/Inf stay visible as in PyTorch's gradients: int8 and full keep them in x_hat; top-k keeps non-finite
entries first, and a row that may have lost some (a row of NaN keeps k of D) makes every entry of dw
NaN, as PyTorch's dw is (`_common.lost_nonfinite`).
"""
from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from ._common import (
    autocast_dtype,
    backward_once,
    call_options,
    cast,
    check_eps,
    check_float,
    check_same_device,
    no_autocast,
)
from ._norm import LayerNormOptions, add_lost, load_normalized, save_normalized, topk_keep

__all__ = ["layer_norm", "topk_keep", "LayerNormOptions"]


def _addcmul_is_layer_norm() -> bool:
    """Whether, on this build's CPU kernels, F.layer_norm(x, w, b) equals addcmul(b, x_hat, w) bit for bit,
    x_hat being layer_norm without affine. The fp32 kernel computes (x * rstd + (-mean * rstd)) * w + b and
    x_hat is its first factor; whether addcmul rounds the last step as the kernel does depends on how
    both were compiled (fused multiply-adds), so it is tried once, at import, on rows with a vectorized
    part and a tail (tests/autograd/test_layernorm.py checks the outputs on every shape it tries)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for rows, d in ((3, 77), (2, 768), (4, 5)):
            x = torch.randn(rows, d, generator=gen) * 2 + 0.5
            w = torch.rand(d, generator=gen) + 0.5
            b = torch.randn(d, generator=gen)
            xhat = torch.native_layer_norm(x, (d,), None, None, 1e-5)[0]
            if not torch.equal(torch.addcmul(b, xhat, w), F.layer_norm(x, (d,), w, b, 1e-5)):
                return False
    return True


_ADDCMUL_IS_LAYER_NORM = _addcmul_is_layer_norm()


def _derives_output(x: torch.Tensor, weight, bias) -> bool:
    """Whether the output is derived from x_hat (one normalizing pass): on the CPU in fp32 with both affine
    parameters, where addcmul(bias, x_hat, weight) is F.layer_norm's output bit for bit. Elsewhere (half
    dtypes, whose kernels take their statistics in another order; CUDA, not checked) the output comes from
    F.layer_norm and x_hat from a second pass."""
    return (_ADDCMUL_IS_LAYER_NORM and x.device.type == "cpu" and x.dtype == torch.float32
            and weight is not None and bias is not None
            and weight.dtype == torch.float32 and bias.dtype == torch.float32)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps, options, compute_dtype):
        with no_autocast(x.device.type):
            xc = x if compute_dtype is None else x.to(compute_dtype)
            wc = weight if compute_dtype is None else cast(weight, compute_dtype)
            bc = bias if compute_dtype is None else cast(bias, compute_dtype)
            # x_hat and rstd in fp32, normalized once (same kernel, same rows as on the (rows, d) view)
            xhat, _, rstd = torch.native_layer_norm(xc.to(torch.float32), normalized_shape, None, None, eps)
            if _derives_output(xc, wc, bc):
                out = torch.addcmul(bc, xhat, wc)
            else:
                out = F.layer_norm(xc, normalized_shape, wc, bc, eps)
            # One normalized dimension: x_hat and rstd are kept in the input's shape (rows = every index but
            # the last), so backward needs no reshape; several: as (rows, d) and (rows, 1).
            flat = len(normalized_shape) == 1 and xc.dim() >= 2
            save_normalized(ctx, options, x, xhat, rstd, weight, xc.dtype, math.prod(normalized_shape), flat)
        ctx.normalized_shape = tuple(normalized_shape)
        ctx.b_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    @backward_once("layer_norm")
    def backward(ctx, grad_out):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        with no_autocast(ctx.device_type):
            # in the input's shape when the rows are contiguous there, else on (rows, d) (`flat` False)
            g, xhat, rstd, weight, saved, flat = load_normalized(ctx, grad_out, need_x or need_w)
            lead = tuple(range(g.dim() - 1))  # the row dimensions, reduced for dw and db
            if need_x or need_w:
                w = None if weight is None else weight.to(torch.float32)
                if w is not None and w.dim() != 1 and not flat:
                    w = w.reshape(ctx.d)
                # PyTorch's own LayerNorm backward (one kernel) run on x̂ as the input, with mean 0 and
                # rstd 1: its dx is (gw - mean(gw) - x̂·mean(gw·x̂)), to be scaled by the real rstd;
                # its dw is sum(g·x̂). Same math as the eager formula, in one pass instead of ~15 ops.
                if need_x:
                    unit = torch.ones_like(rstd)
                    dx, dw, _ = torch.ops.aten.native_layer_norm_backward(
                        g, xhat, (g.shape[-1],), torch.zeros_like(rstd), unit, w, None, [True, need_w, False])
                    del unit
                else:  # the op refuses a mask without dx (torch 2.13: "tensor does not have a device")
                    dx, dw = None, (g * xhat).sum(lead)
                del xhat
                if need_x:
                    dx = dx.mul_(rstd)
                    grad_x = (dx if flat else dx.view(ctx.x_shape)).to(ctx.x_dtype)
                if need_w:  # non-finite entries top-k dropped reach dw
                    dw = add_lost(dw, saved)
                    grad_w = (dw if flat else dw.view(ctx.normalized_shape)).to(ctx.w_dtype)
            if need_b:
                grad_b = g.sum(lead)
                grad_b = (grad_b if flat else grad_b.view(ctx.normalized_shape)).to(ctx.b_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


def _check_affine_dtypes(x: torch.Tensor, weight, bias) -> None:
    """As F.layer_norm: weight and bias in the input's dtype, or both fp32 for a half-precision input
    (PyTorch's mixed-type kernel). Anything else PyTorch refuses deep in its kernel ("mixed dtype
    (CPU)"), naming no argument; under CUDA autocast everything is cast to fp32 first."""
    if x.device.type == "cuda" and autocast_dtype("cuda") is not None:
        return
    dtypes = {t.dtype for t in (weight, bias) if t is not None}
    if not dtypes or dtypes == {x.dtype} or (dtypes == {torch.float32} and x.dtype != torch.float32):
        return
    desc = ", ".join(f"{n}={t.dtype}" for n, t in (("input", x), ("weight", weight), ("bias", bias)) if t is not None)
    raise TypeError(f"slimfit.layer_norm: mismatched dtypes ({desc}); give weight and bias the input's dtype "
                    "(or float32 for a float16 / bfloat16 input)")


def _check_tensors(x, weight, bias) -> None:
    """input, weight and bias: float tensors on one device, affine dtypes as F.layer_norm takes them."""
    check_float("layer_norm", "input", x)
    check_float("layer_norm", "weight", weight)
    check_float("layer_norm", "bias", bias)
    check_same_device("layer_norm", input=x, weight=weight, bias=bias)
    _check_affine_dtypes(x, weight, bias)


def _check_shape(x, normalized_shape, weight, bias, eps) -> tuple:
    """eps and the shapes checked; returns normalized_shape as a tuple of ints."""
    check_eps("layer_norm", eps)
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    if not all(_is_size(s) for s in normalized_shape):
        raise TypeError(f"slimfit.layer_norm: normalized_shape must be ints, got {tuple(normalized_shape)!r}")
    normalized_shape = tuple(int(s) for s in normalized_shape)
    n = len(normalized_shape)
    if n == 0 or x.dim() < n or tuple(x.shape[x.dim() - n:]) != normalized_shape:
        raise ValueError(
            f"slimfit.layer_norm: mismatched shapes: input {tuple(x.shape)} does not end with "
            f"normalized_shape {normalized_shape}"
        )
    if math.prod(normalized_shape) == 0:
        raise ValueError("slimfit.layer_norm: normalized_shape must not contain a zero")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != normalized_shape:
            raise ValueError(
                f"slimfit.layer_norm: mismatched shapes: {name} {tuple(t.shape)} must equal "
                f"normalized_shape {normalized_shape}"
            )
    return normalized_shape


def _is_size(s) -> bool:
    """An int (or 0-dim integer tensor, as torch.Size entries may be), not a bool or a float."""
    try:
        operator.index(s)
    except TypeError:
        return False
    return not isinstance(s, bool)


def layer_norm(
    x: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    save: str = "int8",
    keep_ratio: float = 0.1,
    group_size: int = 128,
    stochastic: bool = False,
    check_finite: bool = False,
    options: LayerNormOptions | None = None,
) -> torch.Tensor:
    """`F.layer_norm` saving x_hat per `save` ('int8' | 'topk' | 'full') plus fp32 rstd per row.
    options: a LayerNormOptions built once (a patched module's), instead of save, keep_ratio, group_size,
    stochastic and check_finite: not checked again.

    Output dtype: as PyTorch (under CUDA autocast layer_norm runs in fp32; CPU autocast leaves
    it alone)."""
    _check_tensors(x, weight, bias)
    options = call_options(LayerNormOptions, options, save=save, keep_ratio=keep_ratio, group_size=group_size,
                           stochastic=stochastic, check_finite=check_finite)
    normalized_shape = _check_shape(x, normalized_shape, weight, bias, eps)
    # PyTorch's autocast runs layer_norm in fp32 on CUDA; CPU autocast does not touch it.
    compute_dtype = torch.float32 if (x.device.type == "cuda" and autocast_dtype("cuda") is not None) else None
    needs_graph = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias)
    )
    if not needs_graph:
        return F.layer_norm(x, normalized_shape, weight, bias, eps)
    return _LayerNorm.apply(x, weight, bias, normalized_shape, float(eps), options, compute_dtype)
