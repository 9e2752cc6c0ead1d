"""Attention through PyTorch's fused kernels, with compressed saved activations.

    O = softmax(Q·Kᵀ·scale + mask)·V        (flash on the CPU; flash / memory-efficient on CUDA)

The forward is PyTorch's own fused op, so O is what `F.scaled_dot_product_attention` gives
(bit for bit on the CPU). The fused kernels never hold the B·H·Sq·Sk scores: they keep a
per-row logsumexp (lse) instead, and their backward recomputes P blockwise from Q, K and lse.
Saved for backward, through `ctx.save_for_backward`:

* Q, K, V quantized per group (8-bit by default) in their logical (B, H, S, D) order, so a
  group runs along the head dimension and never mixes heads. Grouped-query K/V are saved
  with their own (fewer) heads, never expanded.
* the mask as given (bool or additive; it is the model's tensor, shared by all layers);
* with `backward='saved'`: O and the lse of the exact forward (and on CUDA the dropout RNG
  state: philox seed and offset). With `backward='recompute'` (default): nothing else.

Consistency. The fused backward rebuilds P as exp(S̃ − lse) from the dequantized Q̃, K̃, and
uses D = rowsum(dO∘O). With the exact O and lse ('saved') P̃ no longer sums to one and D
belongs to another P: the pieces disagree. 'recompute' reruns the fused forward on
(Q̃, K̃, Ṽ) in backward, so the backward is the exact gradient of attention at the
dequantized point, O need not be kept (one B·H·S·D tensor less per layer), and the cost
is one fused forward per attention in backward. Measured (docs/attention.md): 'recompute'
is as accurate as 'saved' and keeps fewer bytes; it is the default.

Dropout: the CPU fused op refuses dropout (torch 2.13), so `fused_kernel` returns None
there and the caller falls back to the materializing path (slimfit.autograd.attention,
seeded and replayed). On CUDA the fused ops return their philox seed/offset, which are
saved and passed to the fused backward (exact replay); with dropout the CUDA path always
uses 'saved' (a recomputed forward would draw another mask).

The CUDA branch follows PyTorch's own SDPA composite (mask padding for the efficient
kernel, philox state, lse padding) but could not be run here: no GPU in this task.

Options: `FusedAttentionOptions` (qkv_bits, group_size, backward, check_finite), checked once when
built; scale, the mask, causality, dropout and the kernel are per call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from torch import Tensor

from ..kernels.api import quantize
from ..kernels.validation import FLOAT_DTYPES
from ._common import (
    autocast_dtype,
    backward_once,
    call_options,
    check_bits,
    check_flag,
    check_float,
    check_group_size,
    check_same_device,
    check_same_dtype,
    load,
    no_autocast,
    restore,
    save,
)
from .attention import check_mask

__all__ = ["fused_attention", "fused_kernel", "BACKWARD_MODES", "quantized_bytes", "FusedAttentionOptions"]

BACKWARD_MODES = ("recompute", "saved")
_aten = torch.ops.aten
_MEM_EFF_ALIGNMENT = 8  # elements; the efficient kernel's bias rows must start aligned (as SDPA pads)


@dataclass(frozen=True)
class FusedAttentionOptions:
    """What the fused path keeps, checked once, here.

    qkv_bits: 8/4/2 to save Q/K/V quantized per group of `group_size`, or None (kept as they are).
    backward: 'recompute' (rerun the fused forward on the dequantized Q/K/V in backward; keeps nothing
    else) or 'saved' (keep O and the exact logsumexp).
    check_finite: raise on NaN/Inf in Q/K/V when saving them (one host sync per tensor; off by default)."""

    op: ClassVar[str] = "fused_attention"
    qkv_bits: Optional[int] = 8
    group_size: int = 128
    backward: str = "recompute"
    check_finite: bool = False

    def __post_init__(self):
        check_flag(self.op, check_finite=self.check_finite)
        if self.backward not in BACKWARD_MODES:
            raise ValueError(
                f"slimfit.fused_attention: backward must be one of {BACKWARD_MODES}, got {self.backward!r}")
        check_bits(self.op, "qkv_bits", self.qkv_bits, allow_none=True)
        check_group_size(self.op, self.group_size)
        object.__setattr__(self, "group_size", int(self.group_size))


def quantized_bytes(numel: int, bits: int, group_size: int) -> int:
    """Bytes of one tensor saved by `slimfit.kernels.quantize`: packed codes + fp32 scale and offset."""
    return math.ceil(numel * bits / 8) + 8 * math.ceil(numel / group_size)


# ------------------------------------------------------------------ which kernel

def _cuda_params(q, k, v, mask, dropout_p, is_causal, gqa):
    params = torch.backends.cuda.SDPAParams
    try:
        return params(q, k, v, mask, dropout_p, is_causal, gqa)
    except TypeError:  # torch < 2.5: no enable_gqa argument
        return None if gqa else params(q, k, v, mask, dropout_p, is_causal)


@torch.compiler.assume_constant_result
def fused_kernel(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
                 is_causal: bool) -> Optional[str]:
    """'cpu_flash', 'cuda_flash' or 'cuda_efficient' when a fused PyTorch kernel takes these
    inputs (PyTorch's own checks, so `torch.nn.attention.sdpa_kernel` contexts are honoured),
    else None (the caller uses the materializing path). A compiler takes it at trace time (torch's choice
    query returns an int, which dynamo cannot trace): the choice depends on shapes, dtypes and devices, which the
    graph's guards fix, and on the `sdpa_kernel` context at trace time."""
    if not fusable(q, k, v, attn_mask, is_causal):
        return None
    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cpu":
        if dropout_p > 0.0:  # "scaled_dot_product_attention_flash_attention: Currently do not support dropout > 0"
            return None
        choice = _aten._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa=gqa)
        return "cpu_flash" if choice == int(torch.nn.attention.SDPBackend.FLASH_ATTENTION) else None
    if q.device.type == "cuda":
        # SDPA's composite pads odd head dims to a multiple of 8 before calling these kernels; this path
        # does not pad, so it takes only head dims the kernels accept as they are.
        if q.shape[-1] % 8 or v.shape[-1] % 8:
            return None
        cuda = torch.backends.cuda
        if attn_mask is None:
            params = _cuda_params(q, k, v, None, dropout_p, is_causal, gqa)
            if params is not None and cuda.can_use_flash_attention(params, False):
                return "cuda_flash"
        # The efficient kernel has no grouped-query support: it gets K/V expanded transiently.
        hq = q.shape[1]
        k_expanded, v_expanded = (_expand_kv(k, hq), _expand_kv(v, hq)) if gqa else (k, v)
        mask = _additive_mask(attn_mask, q.dtype)
        params = _cuda_params(q, k_expanded, v_expanded, mask, dropout_p, is_causal, False)
        if params is not None and cuda.can_use_efficient_attention(params, False):
            return "cuda_efficient"
    return None


def fusable(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool) -> bool:
    """Whether the inputs have a form the fused kernels take at all (4-D, one float dtype and device, whole
    groups of query heads per kv head, a bool or float mask that needs no gradient), on any device."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.dtype not in FLOAT_DTYPES:
        return False
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        return False
    hq, hk = q.shape[1], k.shape[1]
    if hk == 0 or hq % hk or v.shape[1] != hk or q.shape[0] != k.shape[0]:
        return False
    if attn_mask is not None:
        if is_causal or attn_mask.requires_grad:  # the fused ops give no mask gradient
            return False
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            return False
    return True


# ------------------------------------------------------------------ helpers

def _expand_kv(x: Tensor, heads: int) -> Tensor:
    """(B, Hk, S, D) -> (B, heads, S, D), query head j reading kv head j // (heads / Hk)
    (transformers' repeat_kv, PyTorch's enable_gqa)."""
    b, hk, s, d = x.shape
    return x[:, :, None].expand(b, hk, heads // hk, s, d).reshape(b, heads, s, d)


def _reduce_groups(grad: Tensor, heads: int) -> Tensor:
    """Sum a gradient over the query heads that shared one kv head (no-op when already reduced)."""
    b, h, s, d = grad.shape
    if h == heads:
        return grad
    return grad.view(b, heads, h // heads, s, d).sum(dim=2)


def _additive_mask(mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """Bool (True = attend) -> 0 / -inf in `dtype`, as SDPA converts it; float masks cast.
    The result has the mask's own shape (per batch, not per head)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)


def _efficient_bias(mask: Optional[Tensor], q: Tensor, k: Tensor) -> Optional[Tensor]:
    """The efficient kernel wants a (B, H, Sq, Sk) bias whose rows start 8-element aligned:
    pad the last dim and slice back, then expand (views, as SDPA's preprocess_mask)."""
    if mask is None:
        return None
    aligned = mask.stride(-1) == 1 and all(mask.stride(i) % _MEM_EFF_ALIGNMENT == 0 for i in range(mask.dim() - 1))
    if not aligned:
        row_length = mask.shape[-1]
        padding = _MEM_EFF_ALIGNMENT - row_length % _MEM_EFF_ALIGNMENT
        mask = torch.nn.functional.pad(mask, (0, padding))[..., :row_length]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _forward_op(kernel, q, k, v, mask, dropout_p, is_causal, scale):
    """(out, lse, extras): extras are what the matching backward needs besides q, k, v, out, lse."""
    if kernel == "cpu_flash":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=_additive_mask(mask, q.dtype), scale=scale)
        return out, lse, {}
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:  # the CUDA kernels read rows contiguously
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if kernel == "cuda_flash":
        # cum_q / cum_k come back as None for dense inputs and are passed back as they are
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, is_causal, False, scale=scale)
        return out, lse, {"cum_q": cum_q, "cum_k": cum_k, "max_q": max_q, "max_k": max_k,
                          "philox_seed": seed, "philox_offset": offset}
    hq = q.shape[1]
    k_expanded, v_expanded = (_expand_kv(k, hq), _expand_kv(v, hq)) if k.shape[1] != hq else (k, v)
    bias = _efficient_bias(_additive_mask(mask, q.dtype), q, k_expanded)
    out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(
        q, k_expanded, v_expanded, bias, True, dropout_p, is_causal, scale=scale)
    return out, lse, {"philox_seed": seed, "philox_offset": offset}


def _backward_op(kernel, grad_out, q, k, v, out, lse, extras, mask, dropout_p, is_causal, scale, needs):
    hk = k.shape[1]
    if kernel == "cpu_flash":
        grad_q, grad_k, grad_v = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, dropout_p, is_causal,
            attn_mask=_additive_mask(mask, q.dtype), scale=scale)
    elif kernel == "cuda_flash":
        grad_q, grad_k, grad_v = _aten._scaled_dot_product_flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, extras["cum_q"], extras["cum_k"],
            extras["max_q"], extras["max_k"], dropout_p, is_causal,
            extras["philox_seed"], extras["philox_offset"], scale=scale)
    else:
        hq = q.shape[1]
        k_expanded, v_expanded = (_expand_kv(k, hq), _expand_kv(v, hq)) if hk != hq else (k, v)
        bias = _efficient_bias(_additive_mask(mask, q.dtype), q, k_expanded)
        grad_q, grad_k, grad_v, _ = _aten._scaled_dot_product_efficient_attention_backward(
            grad_out.contiguous(), q, k_expanded, v_expanded, bias, out, lse, extras["philox_seed"],
            extras["philox_offset"], dropout_p, [needs[0], needs[1], needs[2], False], is_causal,
            scale=scale)
    grad_k = None if grad_k is None else _reduce_groups(grad_k, hk)
    grad_v = None if grad_v is None else _reduce_groups(grad_v, hk)
    return grad_q, grad_k, grad_v


# ------------------------------------------------------------------ autograd function

_EXTRA_TENSORS = ("cum_q", "cum_k", "philox_seed", "philox_offset")


class _FusedAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, scale, is_causal, dropout_p, kernel, options):
        out, lse, extras = _forward_op(kernel, q, k, v, attn_mask, dropout_p, is_causal, scale)
        # the NaN/Inf check reads a value on the host
        check = options.check_finite and not torch.compiler.is_compiling()
        if options.qkv_bits is None:
            saved = [q, k, v]
        else:
            # in memory order: transposed views of a projection are quantized without a copy
            saved = [quantize(x, options.qkv_bits, options.group_size, check_finite=check, storage_order=True)
                     for x in (q, k, v)]
        keep_forward = options.backward == "saved" or dropout_p > 0.0  # a recomputed forward would draw another mask
        saved += [attn_mask, out if keep_forward else None, lse if keep_forward else None]
        saved += [extras.get(name) for name in _EXTRA_TENSORS]
        save(ctx, *saved)
        ctx.max_seqlens = (extras.get("max_q"), extras.get("max_k"))
        ctx.kernel, ctx.scale, ctx.is_causal, ctx.dropout_p = kernel, scale, is_causal, dropout_p
        ctx.device_type, ctx.dtype = q.device.type, q.dtype
        return out

    @staticmethod
    @backward_once("fused_attention")
    def backward(ctx, grad_out):
        with no_autocast(ctx.device_type):
            saved_q, saved_k, saved_v, mask, out, lse, *rest = load(ctx)
            dtype = ctx.dtype
            grad_out = grad_out.to(dtype)
            q, k, v = restore(saved_q, dtype), restore(saved_k, dtype), restore(saved_v, dtype)
            del saved_q, saved_k, saved_v
            extras = dict(zip(_EXTRA_TENSORS, rest))
            extras["max_q"], extras["max_k"] = ctx.max_seqlens
            if out is None:  # 'recompute': O and lse of the dequantized point, consistent with P̃
                out, lse, fresh = _forward_op(ctx.kernel, q, k, v, mask, 0.0, ctx.is_causal, ctx.scale)
                extras.update(fresh)
            grad_q, grad_k, grad_v = _backward_op(ctx.kernel, grad_out, q, k, v, out, lse, extras, mask,
                                                  ctx.dropout_p, ctx.is_causal, ctx.scale, ctx.needs_input_grad[:3])
        needs = ctx.needs_input_grad
        return (grad_q if needs[0] else None, grad_k if needs[1] else None, grad_v if needs[2] else None) + (None,) * 6


# ------------------------------------------------------------------ public entry

def _check_tensors(q, k, v):
    """q, k, v checked before a kernel is chosen, so a mistake (mixed dtypes or devices) is named as such,
    not reported as "no fused kernel takes these inputs"."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float("fused_attention", name, t)
        if t.dim() != 4:
            raise ValueError(f"slimfit.fused_attention: {name} must be shaped (B, H, S, D), got {tuple(t.shape)}")
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"slimfit.fused_attention: shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} (k and v share (B, Hk, Sk); q and k share B and D)")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"slimfit.fused_attention: {q.shape[1]} query heads are not a multiple of "
                         f"{k.shape[1]} key/value heads")
    check_same_device("fused_attention", q=q, k=k, v=v)
    if autocast_dtype(q.device.type) is None:  # autocast casts them to one dtype
        check_same_dtype("fused_attention", q=q, k=k, v=v)


def _check_call(q, k, attn_mask, is_causal, dropout_p, scale):
    """The per-call arguments (the options are checked when built; a mask that does not fit is named)."""
    if not (0.0 <= float(dropout_p) <= 1.0):
        raise ValueError(f"slimfit.fused_attention: dropout_p must be in [0, 1], got {dropout_p!r}")
    if scale is not None and not math.isfinite(float(scale)):
        raise ValueError(f"slimfit.fused_attention: scale must be a finite number, got {scale!r}")
    check_mask("fused_attention", attn_mask, q, k, is_causal)


def fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: Optional[float] = None,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    training: bool = True,
    qkv_bits: Optional[int] = 8,
    group_size: int = 128,
    backward: str = "recompute",
    check_finite: bool = False,
    options: Optional[FusedAttentionOptions] = None,
) -> Tensor:
    """softmax(q·kᵀ·scale + mask)·v through PyTorch's fused kernel; Q/K/V saved compressed.

    q: (B, Hq, Sq, D); k: (B, Hk, Sk, D); v: (B, Hk, Sk, Dv) with Hq a multiple of Hk
    (grouped-query attention: query head j reads kv head j // (Hq/Hk); K/V are never saved
    expanded). attn_mask: bool (True = attend) or additive float, broadcastable to
    (B, Hq, Sq, Sk); is_causal: top-left aligned, as SDPA. qkv_bits, group_size, backward,
    check_finite: what is saved (FusedAttentionOptions says what each means); or `options`, a
    FusedAttentionOptions built once (a patched model's): not checked again.

    Raises ValueError when no fused kernel takes these inputs (see `fused_kernel`; e.g.
    attention dropout on the CPU): use slimfit.autograd.attention there.
    """
    check_flag("fused_attention", training=training)
    _check_tensors(q, k, v)
    options = call_options(FusedAttentionOptions, options, qkv_bits=qkv_bits, group_size=group_size,
                           backward=backward, check_finite=check_finite)
    _check_call(q, k, attn_mask, is_causal, dropout_p, scale)
    amp_dtype = autocast_dtype(q.device.type)
    if amp_dtype is not None:
        q, k, v = q.to(amp_dtype), k.to(amp_dtype), v.to(amp_dtype)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
    p_drop = float(dropout_p) if training else 0.0
    kernel = fused_kernel(q, k, v, attn_mask, p_drop, bool(is_causal))
    if kernel is None:
        raise ValueError(
            "slimfit.fused_attention: no fused PyTorch kernel takes these inputs (device "
            f"{q.device.type}, dtype {q.dtype}, dropout {p_drop}, mask "
            f"{None if attn_mask is None else (attn_mask.dtype, tuple(attn_mask.shape))}); use "
            "slimfit.autograd.attention (the materializing path) instead")
    needs_graph = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    with no_autocast(q.device.type):
        if not needs_graph:
            with torch.no_grad():
                out, _, _ = _forward_op(kernel, q, k, v, attn_mask, p_drop, bool(is_causal), float(scale))
            return out
        return _FusedAttentionFn.apply(q, k, v, attn_mask, float(scale), bool(is_causal), p_drop, kernel, options)
