"""Attention core with compressed saved activations.

    P = softmax(Q·Kᵀ·scale + mask)        O = dropout(P)·V

The forward is computed exactly (same math as `F.scaled_dot_product_attention`). For
backward only these are kept, through `ctx.save_for_backward`:

* Q, K, V quantized per group at `qkv_bits` (8 by default; None keeps them as they are);
* P compressed per `probs`: 'topk' (the ceil(keep_ratio·Sk) largest entries of each row,
  values in the compute dtype plus int16 indices), 'int8' / 'int4' (per-group min/max
  codes), 'full', or 'recompute': P is not kept at all (nor anything S×S); backward
  rebuilds it from Q̃, K̃ and the mask (the mask is the model's tensor, saved as given),
  one more Q·Kᵀ GEMM and softmax per attention;
* for attention dropout nothing at all: the mask is regenerated in backward from a seed
  with the counter-based generator (`slimfit.kernels.dropout_mask`).

Backward uses exactly what was saved (P̃ = restored P, or softmax(Q̃·K̃ᵀ·scale + mask) with
'recompute'; Q̃, K̃, Ṽ = dequantized inputs, D = the regenerated dropout, identity when off):

    dP = D(dO·Ṽᵀ)     dS = P̃∘(dP − rowsum(dP∘P̃))     dQ = (dS·scale)·K̃
    dK = (dS·scale)ᵀ·Q̃     dV = D(P̃)ᵀ·dO

With 'recompute' the backward is exactly the gradient of attention at (Q̃, K̃, Ṽ) with the
forward's dropout mask: the same consistency as the fused path's 'recompute' backward, for
the calls no fused kernel takes (attention dropout on the CPU).

`dropout_mode='on_v'` applies the dropout to V instead of P (O = P·dropout(V)), as the
SlimFit research code does. It is a different model (it drops value features, not
attention links), so it is opt-in; see docs/attention.md.

Options: `AttentionOptions` (qkv_bits, probs, keep_ratio, group_size, dropout_mode, check_finite),
checked once when built; scale, the mask, causality and the dropout probability are per call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from torch import Tensor

from ..kernels.api import PrunedTensor, quantize, topk_prune
from ..kernels.reference import apply_keep
from ._common import (
    autocast_dtype,
    backward_once,
    call_options,
    check_bits,
    check_flag,
    check_float,
    check_group_size,
    check_same_dtype,
    load,
    lost_nonfinite,
    no_autocast,
    restore,
    save,
)
from .dropout import apply_seeded_dropout, draw_seed, keep_mask

__all__ = ["attention", "check_mask", "PROBS_MODES", "DROPOUT_MODES", "topk_keep", "AttentionOptions"]

PROBS_MODES = ("topk", "int8", "int4", "full", "recompute")
DROPOUT_MODES = ("seed", "on_v")
_PROBS_BITS = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class AttentionOptions:
    """What the materializing attention keeps, checked once, here.

    qkv_bits: 8 (default), 4 or 2 to save Q, K, V quantized per group; None keeps them.
    probs: how P is saved: 'full' (default, as SlimFitConfig's AttentionSaving), 'topk' (keep
    ceil(keep_ratio·Sk) per row), 'int8', 'int4', or 'recompute' (not saved: rebuilt in backward from the
    saved Q, K and the mask).
    group_size: quantization group (32, 64, 128 or 256 consecutive elements).
    dropout_mode: 'seed' (dropout on P, mask regenerated from a seed, nothing saved) or
    'on_v' (dropout on V, as the SlimFit research code; changes the model).
    check_finite: raise on NaN/Inf in what is saved (one host sync per saved tensor; off by default)."""

    op: ClassVar[str] = "attention"
    qkv_bits: Optional[int] = 8
    probs: str = "full"
    keep_ratio: float = 0.1
    group_size: int = 128
    dropout_mode: str = "seed"
    check_finite: bool = False

    def __post_init__(self):
        check_flag(self.op, check_finite=self.check_finite)
        if self.probs not in PROBS_MODES:
            raise ValueError(f"slimfit.attention: probs must be one of {PROBS_MODES}, got {self.probs!r}")
        ratio = self.keep_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (0.0 < ratio <= 1.0):
            raise ValueError(f"slimfit.attention: keep_ratio must be in (0, 1], got {ratio!r}")
        check_bits(self.op, "qkv_bits", self.qkv_bits, allow_none=True)
        check_group_size(self.op, self.group_size)
        if self.dropout_mode not in DROPOUT_MODES:
            raise ValueError(
                f"slimfit.attention: dropout_mode must be one of {DROPOUT_MODES}, got {self.dropout_mode!r}")
        object.__setattr__(self, "keep_ratio", float(ratio))
        object.__setattr__(self, "group_size", int(self.group_size))


def topk_keep(keep_ratio: float, row_length: int) -> int:
    """Entries kept per row of P: ceil(keep_ratio · Sk), at least 1 (at most Sk).

    A tiny tolerance keeps float noise from adding an entry (0.1 · 30 = 3.0000000000000004)."""
    return min(row_length, max(1, math.ceil(keep_ratio * row_length - 1e-9)))


# ------------------------------------------------------------------ forward math

def _masked_scores(scores: Tensor, attn_mask: Optional[Tensor], is_causal: bool) -> Tensor:
    """scores: a fresh fp32 (..., Sq, Sk) tensor; the mask is applied in place.

    A bool or causal mask is added as 0 / -inf, as SDPA's math backend converts it, rather than written
    over the scores: a NaN (or +Inf) score at a masked position stays NaN and makes its row NaN, as in
    PyTorch, instead of being overwritten and vanishing from the output and the gradients."""
    if is_causal:
        sq, sk = scores.shape[-2:]
        scores.add_(torch.full((sq, sk), float("-inf"), device=scores.device).triu_(1))
    elif attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            additive = torch.zeros(attn_mask.shape, dtype=torch.float32, device=scores.device)
            scores.add_(additive.masked_fill_(~attn_mask, float("-inf")))
        else:
            scores.add_(attn_mask.to(torch.float32))
    return scores


def _math_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """dtype of the GEMMs. fp16/bf16 on the CPU run in fp32 (as PyTorch's CPU attention does:
    half-precision rounding of the scores would double the error, and CPU GEMMs gain little
    from 16 bits); elsewhere the input dtype (tensor cores accumulate in fp32 anyway)."""
    return torch.float32 if device_type == "cpu" else dtype


def _bmm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for (..., m, k) @ (..., k, n) with equal leading dims, as one bmm on 3-D views: the
    GEMM torch.matmul runs (same bits) without its expand/reshape round trip (fewer dispatched ops)."""
    lead = a.shape[:-2]
    batch = math.prod(lead)
    out = torch.bmm(a.reshape(batch, a.shape[-2], a.shape[-1]), b.reshape(batch, b.shape[-2], b.shape[-1]))
    return out.view(*lead, a.shape[-2], b.shape[-1])


def _capped_scores(q: Tensor, k: Tensor, scale: float, softcap: Optional[float]) -> Tensor:
    """q·kᵀ·scale, soft-capped as Gemma2's attention computes it (cap·tanh(s / cap)) when `softcap`."""
    math_dtype = _math_dtype(q.dtype, q.device.type)
    scores = _bmm(q.to(math_dtype), k.to(math_dtype).transpose(-2, -1)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return scores


def _probs(q: Tensor, k: Tensor, scale: float, attn_mask: Optional[Tensor], is_causal: bool,
           softcap: Optional[float] = None) -> Tensor:
    """P = softmax(cap(q·kᵀ·scale) + mask) in fp32 (cap: identity, or the soft cap). A row whose keys are
    all masked gives zeros (as PyTorch's scaled_dot_product_attention), not NaN."""
    scores = _capped_scores(q, k, scale, softcap)
    # A fresh tensor either way (the cast is a no-op for fp32), so masking may work in place.
    scores = _masked_scores(scores.to(torch.float32), attn_mask, is_causal)
    p = torch.softmax(scores, dim=-1)
    if scores.numel() and (attn_mask is not None or is_causal):
        dead = scores.amax(dim=-1, keepdim=True) == float("-inf")
        p.masked_fill_(dead, 0.0)
    return p


def _output(p32: Tensor, v: Tensor, dropout_p: float, dropout_mode: str, seed) -> Tensor:
    """dropout(P)·V (or P·dropout(V)) in the math dtype, returned in v's dtype. `seed`: None (no
    dropout), an int, or a 0-dim tensor (torch.compile: drawn in the graph, no recompile per step)."""
    math_dtype = _math_dtype(v.dtype, v.device.type)
    p, v_math = p32.to(math_dtype), v.to(math_dtype)
    if seed is None:
        out = _bmm(p, v_math)
    elif dropout_mode == "seed":
        out = _bmm(apply_seeded_dropout(p, dropout_p, seed), v_math)
    else:  # on_v
        out = _bmm(p, apply_seeded_dropout(v_math, dropout_p, seed))
    # No no-op .to: torch 2.11's dynamo would return the GEMM's tensor twice from _AttentionFn's traced
    # forward and route its gradient to the wrong output (zeros; pytorch/pytorch#180642).
    return out if out.dtype == v.dtype else out.to(v.dtype)


# ------------------------------------------------------------------ autograd function

class _AttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, scale, is_causal, dropout_p, softcap, options):
        compute_dtype = q.dtype
        seed = draw_seed() if dropout_p > 0.0 else None
        p32 = _probs(q, k, scale, attn_mask, is_causal, softcap)
        out = _output(p32, v, dropout_p, options.dropout_mode, seed)
        p = p32.to(compute_dtype)  # P is stored in the input dtype (no copy for fp32)

        # ---- what backward keeps: Q, K, V (quantized unless qkv_bits is None), compressed P
        # The NaN/Inf checks of the primitives read a value back to the host: a graph break
        # under torch.compile, so they are skipped while compiling.
        check = options.check_finite and not torch.compiler.is_compiling()
        qkv_bits, probs, group_size = options.qkv_bits, options.probs, options.group_size
        if qkv_bits is None:
            saved_qkv = (q, k, v)
        else:
            # logical order: backward's batched GEMMs want (B·H, S, D) rows, so quantizing a transposed
            # view in memory order would only move its copy into backward (fused_attention's kernels
            # take the strided view as it is, so that path quantizes in memory order)
            saved_qkv = tuple(quantize(x, qkv_bits, group_size, check_finite=check) for x in (q, k, v))
        if probs == "recompute":
            saved_p = None  # rebuilt in backward from Q̃, K̃ and the mask
        elif probs == "full" or p.numel() == 0:
            saved_p = p
        elif probs == "topk":
            # P >= 0, so the largest by value are the largest by magnitude (cheaper key).
            saved_p = topk_prune(p, k=topk_keep(options.keep_ratio, p.shape[-1]), by_magnitude=False,
                                 check_finite=check)
        else:  # int8 / int4, quantized from the fp32 probabilities
            saved_p = quantize(p32, _PROBS_BITS[probs], group_size, check_finite=check)
        del p32
        seed_tensor = seed if isinstance(seed, Tensor) else None  # compiled: saved like any tensor (8 bytes)
        saved_mask = attn_mask if probs == "recompute" else None
        save(ctx, *saved_qkv, saved_p, seed_tensor, saved_mask)

        ctx.compute_dtype = compute_dtype
        ctx.scale = scale
        ctx.softcap = softcap
        ctx.is_causal = is_causal
        ctx.seed = None if seed_tensor is not None else seed
        ctx.dropout_p = dropout_p
        ctx.dropout_mode = options.dropout_mode
        ctx.mask_shape = None
        ctx.mask_dtype = None
        if attn_mask is not None and attn_mask.is_floating_point():
            ctx.mask_shape = tuple(attn_mask.shape)
            ctx.mask_dtype = attn_mask.dtype
        ctx.device_type = q.device.type
        return out

    @staticmethod
    @backward_once("attention")  # create_graph=True raises, naming the op
    def backward(ctx, grad_out):
        with no_autocast(ctx.device_type):
            return _AttentionFn._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        compute_dtype = ctx.compute_dtype
        math_dtype = _math_dtype(compute_dtype, ctx.device_type)
        saved_q, saved_k, saved_v, saved_p, seed_tensor, mask = load(ctx)
        q = restore(saved_q, math_dtype)
        k = restore(saved_k, math_dtype)
        v = restore(saved_v, math_dtype)
        if saved_p is None:  # 'recompute': P̃ of the dequantized point, consistent with Q̃, K̃
            p32 = _probs(q, k, ctx.scale, mask, ctx.is_causal, ctx.softcap)
        else:
            p32 = restore(saved_p, torch.float32)  # no copy when P was saved in fp32
        # a row of NaN probabilities makes all of PyTorch's dV (of that head) NaN; top-k kept k of them
        lost = lost_nonfinite(saved_p).sum(dim=-2, keepdim=True) if isinstance(saved_p, PrunedTensor) else None
        del saved_q, saved_k, saved_v, saved_p, mask
        p = p32.to(math_dtype)
        grad_out = grad_out.to(math_dtype)

        seed = seed_tensor if seed_tensor is not None else ctx.seed
        dropout_p, mode = ctx.dropout_p, ctx.dropout_mode
        if seed is not None and mode == "seed":  # the mask is regenerated once, used twice
            keep = keep_mask(p, dropout_p, seed)
            grad_v = _bmm(apply_keep(p, keep, dropout_p).transpose(-2, -1), grad_out)
            grad_p = apply_keep(_bmm(grad_out, v.transpose(-2, -1)), keep, dropout_p)
            del keep
        elif seed is not None:  # on_v: O = P·D(V)
            keep = keep_mask(v, dropout_p, seed)
            grad_v = apply_keep(_bmm(p.transpose(-2, -1), grad_out), keep, dropout_p)
            grad_p = _bmm(grad_out, apply_keep(v, keep, dropout_p).transpose(-2, -1))
            del keep
        else:
            grad_v = _bmm(p.transpose(-2, -1), grad_out)
            grad_p = _bmm(grad_out, v.transpose(-2, -1))
        del v, p

        # softmax backward in fp32 (no-op casts for fp32 inputs): dS = P∘(dP − rowsum(dP∘P)),
        # with the same fused kernel autograd uses for torch.softmax.
        grad_s = torch.ops.aten._softmax_backward_data(grad_p.to(torch.float32), p32, -1, torch.float32)
        del grad_p, p32

        grad_mask = None
        if ctx.mask_shape is not None and ctx.needs_input_grad[3]:
            grad_mask = grad_s.sum_to_size(ctx.mask_shape).to(ctx.mask_dtype)

        if ctx.softcap is not None:  # through cap·tanh(s / cap): d/ds = 1 - tanh², at the dequantized point
            capped = _capped_scores(q, k, ctx.scale, ctx.softcap).to(torch.float32) / ctx.softcap
            grad_s = grad_s * (1.0 - capped * capped)
            del capped
        grad_s_scaled = (grad_s * ctx.scale).to(math_dtype)
        del grad_s
        grad_q = _bmm(grad_s_scaled, k).to(compute_dtype) if ctx.needs_input_grad[0] else None
        # dK = dSᵀ·Q computed as (Qᵀ·dS)ᵀ: the same GEMM autograd runs for q @ k.mT.
        grad_k = None
        if ctx.needs_input_grad[1]:
            grad_k = _bmm(q.transpose(-2, -1), grad_s_scaled).transpose(-2, -1).to(compute_dtype)
        if lost is not None:
            grad_v = grad_v + lost
        grad_v = grad_v.to(compute_dtype) if ctx.needs_input_grad[2] else None
        return grad_q, grad_k, grad_v, grad_mask, None, None, None, None, None


# ------------------------------------------------------------------ validation

def _check_tensors(q, k, v, autocast_on):
    """q, k, v: float tensors of one dtype (unless autocast casts them) and device, with fitting shapes."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float("attention", name, t)
        if t.dim() < 2:
            raise ValueError(
                f"slimfit.attention: {name} must be shaped (..., seq, head_dim), e.g. (B, H, S, D); "
                f"got shape {tuple(t.shape)}"
            )
    if q.dim() != k.dim() or q.dim() != v.dim() or q.shape[:-2] != k.shape[:-2] or q.shape[:-2] != v.shape[:-2]:
        raise ValueError(
            "slimfit.attention: q, k and v must share their leading (batch, head) dimensions; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (broadcasting and "
            "grouped-query heads are not supported: repeat K/V heads first)"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"slimfit.attention: q and k head dims differ: q {tuple(q.shape)} vs k {tuple(k.shape)}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"slimfit.attention: k and v sequence lengths differ: k {tuple(k.shape)} vs v {tuple(v.shape)}"
        )
    if not autocast_on:  # autocast casts them to one dtype
        check_same_dtype("attention", q=q, k=k, v=v)
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"slimfit.attention: q, k, v are on different devices: {q.device}, {k.device}, {v.device}"
        )


def _check_call(q, k, attn_mask, is_causal, dropout_p, scale):
    """The per-call arguments (the options are checked when built)."""
    if not (0.0 <= float(dropout_p) <= 1.0):
        raise ValueError(f"slimfit.attention: dropout_p must be in [0, 1], got {dropout_p!r}")
    if scale is not None and not math.isfinite(float(scale)):
        raise ValueError(f"slimfit.attention: scale must be a finite number, got {scale!r}")
    check_mask("attention", attn_mask, q, k, is_causal)


def check_mask(op: str, attn_mask: Optional[Tensor], q: Tensor, k: Tensor, is_causal: bool) -> None:
    """attn_mask: None, or a bool (True = attend) / additive float tensor on q's device that broadcasts
    to the score shape (..., Sq, Sk); never together with is_causal (as scaled_dot_product_attention)."""
    if attn_mask is None:
        return
    if is_causal:
        raise ValueError(f"slimfit.{op}: give either attn_mask or is_causal=True, not both "
                         "(as scaled_dot_product_attention)")
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"slimfit.{op}: attn_mask must be a tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(
            f"slimfit.{op}: attn_mask must be bool (True = attend) or an additive float mask, "
            f"got {attn_mask.dtype}"
        )
    if attn_mask.device != q.device:
        raise ValueError(f"slimfit.{op}: attn_mask is on {attn_mask.device}, q on {q.device}")
    target = tuple(q.shape[:-1]) + (k.shape[-2],)
    try:
        ok = torch.broadcast_shapes(attn_mask.shape, target) == torch.Size(target)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"slimfit.{op}: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
            f"the score shape {target} (batch..., Sq, Sk)"
        )


# ------------------------------------------------------------------ public entry

def attention(
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
    probs: str = "full",
    keep_ratio: float = 0.1,
    group_size: int = 128,
    dropout_mode: str = "seed",
    check_finite: bool = False,
    softcap: Optional[float] = None,
    options: Optional[AttentionOptions] = None,
) -> Tensor:
    """softmax(q·kᵀ·scale + mask)·v with compressed activations saved for backward; with `softcap`,
    the scores are soft-capped first, cap·tanh(s / cap), as Gemma2's attention does.

    q: (..., Sq, D), k: (..., Sk, D), v: (..., Sk, Dv), e.g. (B, H, S, D); leading dims equal.
    scale: defaults to 1/sqrt(D). attn_mask: bool (True = attend) or additive float,
    broadcastable to (..., Sq, Sk); is_causal: top-left aligned causal mask (as SDPA).
    dropout_p: attention dropout, applied only when `training`.
    qkv_bits, probs, keep_ratio, group_size, dropout_mode, check_finite: what is saved (AttentionOptions
    says what each means); or `options`, an AttentionOptions built once (a patched model's): not checked again.
    Rows whose every key is masked give a zero output and zero gradients (as PyTorch).
    Under torch.autocast, q, k, v (and a float mask) are cast to the autocast dtype and the
    output has that dtype, as scaled_dot_product_attention.
    """
    amp_dtype = autocast_dtype(q.device.type) if isinstance(q, Tensor) else None
    check_flag("attention", training=training)
    _check_tensors(q, k, v, amp_dtype is not None)
    options = call_options(AttentionOptions, options, qkv_bits=qkv_bits, probs=probs, keep_ratio=keep_ratio,
                           group_size=group_size, dropout_mode=dropout_mode, check_finite=check_finite)
    _check_call(q, k, attn_mask, is_causal, dropout_p, scale)
    if softcap is not None and not (isinstance(softcap, (int, float)) and not isinstance(softcap, bool)
                                    and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"slimfit.attention: softcap must be None or a positive number, got {softcap!r}")
    softcap = None if softcap is None else float(softcap)
    if amp_dtype is not None:
        q, k, v = q.to(amp_dtype), k.to(amp_dtype), v.to(amp_dtype)
    if amp_dtype is not None and attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.to(amp_dtype)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
    p_drop = float(dropout_p) if training else 0.0
    needs_graph = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad
        or (attn_mask is not None and attn_mask.requires_grad)
    )
    with no_autocast(q.device.type):
        if not needs_graph:  # inference: nothing to save, plain math
            seed = draw_seed() if p_drop > 0.0 else None
            p32 = _probs(q, k, float(scale), attn_mask, bool(is_causal), softcap)
            return _output(p32, v, p_drop, options.dropout_mode, seed)
        return _AttentionFn.apply(q, k, v, attn_mask, float(scale), bool(is_causal), p_drop, softcap, options)
