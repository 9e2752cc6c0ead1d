"""slimfit's attention core inside Hugging Face models, through the transformers attention
registry (no modeling code copied).

Two implementations are registered, one per original implementation, so that the mask a
model builds is the same as before patching: `slimfit_sdpa` (boolean or no mask, as for
sdpa) and `slimfit_eager` (additive float mask, as for eager). When no gradient is needed
the original function runs, so inference is bit-identical to the unpatched model.
"""
from __future__ import annotations

import sys
import warnings

import torch

from .. import autograd as sf

ATTENTION_OPTIONS = "_slimfit_attention"
IMPLEMENTATIONS = {"sdpa": "slimfit_sdpa", "eager": "slimfit_eager"}
_registered = False
_warned_unpatched = False


def _original_function(original: str, module):
    if original == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    # Each modeling file defines its own eager_attention_forward.
    return sys.modules[type(module).__module__].eager_attention_forward


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def _make(original: str):
    def slimfit_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                          is_causal=None, **kwargs):
        global _warned_unpatched
        opts = getattr(module, ATTENTION_OPTIONS, None)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        unsupported = kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
        if opts is None or not needs_grad or unsupported:
            if opts is None and needs_grad and not _warned_unpatched:
                warnings.warn(f"slimfit: {type(module).__name__} was not patched; using {original} attention")
                _warned_unpatched = True
            fn = _original_function(original, module)
            return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                      **({"is_causal": is_causal} if original == "sdpa" else {}), **kwargs)
        groups = getattr(module, "num_key_value_groups", 1)
        if groups > 1:
            key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
        q_len, kv_len = query.shape[2], key.shape[2]
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
        causal = bool(q_len > 1 and attention_mask is None and causal)
        if causal and kv_len > q_len:
            key, value = key[:, :, :q_len], value[:, :, :q_len]
        out = sf.attention(
            query, key, value, scale=scaling, attn_mask=attention_mask, is_causal=causal,
            dropout_p=dropout, training=module.training, qkv_bits=opts["qkv_bits"], probs=opts["probs"],
            keep_ratio=opts["keep_ratio"], group_size=opts["group_size"],
            dropout_mode="on_v" if opts["dropout_on_v"] else "seed",
        )
        return out.transpose(1, 2).contiguous(), None

    slimfit_attention.__name__ = f"slimfit_attention_{original}"
    return slimfit_attention


def register() -> None:
    """Registers slimfit_sdpa / slimfit_eager with transformers (once)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    masks = {"sdpa": sdpa_mask, "eager": eager_mask}
    for original, name in IMPLEMENTATIONS.items():
        AttentionInterface.register(name, _make(original))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, masks[original])
    _registered = True
