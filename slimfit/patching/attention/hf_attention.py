"""slimfit's attention core for one call of a transformers attention function (no modeling
code copied): `attend` takes the arguments transformers' sdpa / eager attention functions take,
with the mask the model built for its own implementation. How calls get here without changing
which implementation the model runs: `routes.py`.

Each call takes one of two paths (`choose_path`, docs/attention.md "Which path"):
* 'fused': PyTorch's fused kernel, Q/K/V saved compressed, nothing of size S×S kept or
  allocated (slimfit.autograd.fused_attention); grouped-query K/V are not expanded;
* 'materialize': slimfit's core with compressed P (slimfit.autograd.attention), K/V expanded.
The AttentionOptions holds each path's autograd options (`fused`, `materialize`), made once at patch time
and passed down as they are.
"""

from __future__ import annotations

import warnings

import torch

from ... import autograd
from ...autograd.attention import topk_keep
from ...autograd.fused_attention import fused_kernel, quantized_bytes
from ...config import ATTENTION_PATHS
from ..options import AttentionOptions

PATHS = ATTENTION_PATHS  # choose_path's choices (declared with the config's check of them)
_warned_fallback: set = set()


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def _saved_bytes(path: str, opts: AttentionOptions | dict, query, key, value) -> int:
    """What a path keeps for backward for these shapes, by the formats' byte formulas (the
    mask is left out: it is the model's tensor, shared by every layer, and both paths see it)."""
    opts = AttentionOptions.of(opts)
    bits, group_size = opts.qkv_bits, opts.group_size
    b, hq, sq, _ = query.shape
    kv_heads = hq if path == "materialize" else key.shape[1]  # the materializing path keeps K/V expanded
    total = 0
    for tensor, tensor_heads in ((query, hq), (key, kv_heads), (value, kv_heads)):
        numel = tensor.numel() // tensor.shape[1] * tensor_heads
        total += numel * tensor.element_size() if bits is None else quantized_bytes(numel, bits, group_size)
    if path == "fused" or opts.probs == "recompute":
        return total
    probs_numel = b * hq * sq * key.shape[2]
    probs = opts.probs
    if probs == "full":
        return total + probs_numel * query.element_size()
    if probs == "topk":
        kept = topk_keep(opts.keep_ratio, key.shape[2])
        return total + b * hq * sq * kept * (query.element_size() + (2 if key.shape[2] <= 32768 else 4))
    return total + quantized_bytes(probs_numel, 8 if probs == "int8" else 4, group_size)


def choose_path(opts: AttentionOptions | dict, query, key, value, mask, dropout_p: float,
                is_causal: bool) -> tuple[str, str]:
    """(path, why) for one call. 'auto' takes the fused path whenever PyTorch has a fused kernel
    for the inputs and it keeps no more bytes than the materializing path (with the default
    recompute backward it keeps only Q/K/V, so it always does); 'fused' takes it whenever a
    kernel exists; 'materialize' never. Without a kernel (e.g. attention dropout on the CPU,
    where PyTorch's fused op refuses dropout) the materializing path runs. `opts`: AttentionOptions
    (or a dict of its fields)."""
    opts = AttentionOptions.of(opts)
    wanted = opts.path
    if wanted == "materialize":
        return "materialize", "attention.path='materialize'"
    if opts.dropout_on_v and dropout_p > 0.0:
        return "materialize", "experimental.dropout_on_v (dropout on V exists only in the materializing path)"
    kernel = fused_kernel(query, key, value, mask, dropout_p, is_causal)
    if kernel is None:
        return "materialize", (f"no fused PyTorch kernel for these inputs ({query.device.type}, {query.dtype}, "
                               f"dropout {dropout_p}, mask {None if mask is None else mask.dtype})")
    if wanted == "auto" and _saved_bytes("materialize", opts, query, key, value) < _saved_bytes(
            "fused", opts, query, key, value):
        return "materialize", "fewer saved bytes"
    return "fused", kernel


def attend(module, opts: AttentionOptions, query, key, value, attention_mask, dropout=0.0, scaling=None,
           is_causal=None, softcap=None):
    """slimfit's attention for one call of a transformers attention function (sdpa or eager
    signature): (output in (B, S, H, D) layout, None), as those functions return. `softcap` (Gemma2's
    eager attention): scores soft-capped, which only the materializing core computes."""
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    if causal and kv_len > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    p_drop = float(dropout) if module.training else 0.0
    path, why = choose_path(opts, query, key, value, attention_mask, p_drop, causal)
    if softcap is not None:
        path, why = "materialize", "soft-capped scores (no fused kernel computes them)"
    if path == "fused":
        out = autograd.fused_attention(query, key, value, scale=scaling, attn_mask=attention_mask, is_causal=causal,
                                       dropout_p=dropout, training=module.training, options=opts.fused)
        return out.transpose(1, 2).contiguous(), None
    if opts.path == "fused" and why not in _warned_fallback:
        warnings.warn(f"slimfit: attention.path='fused' but {why}; {type(module).__name__} uses the "
                      "materializing path (P saved compressed, dropout replayed from a seed)",
                      stacklevel=1)  # the caller is transformers' attention forward, not the user's code
        _warned_fallback.add(why)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    out = autograd.attention(query, key, value, scale=scaling, attn_mask=attention_mask, is_causal=causal,
                             dropout_p=dropout, training=module.training, softcap=softcap, options=opts.materialize)
    return out.transpose(1, 2).contiguous(), None
