"""DeBERTa's disentangled self-attention through slimfit (slimfit.autograd.disentangled_attention).

DeBERTa computes its attention itself (bmm, gathered relative-position terms, softmax, dropout, bmm), so
no call reaches transformers' attention functions or SDPA: its module keeps P, the dropped P and its mask,
Q and K twice and two S×S index tensors per layer. Recognised by structure (query/key/value projections,
`transpose_for_scores`, `disentangled_attention_bias`, `pos_att_type`) and taken only when a patch-time
probe gives output bit-identical to the module's own forward (dropout off). A call the core does not
cover (output_attentions, query_states, relative positions given per batch) runs the module's own
forward and is counted as a fallback with its reason.
"""
from __future__ import annotations

import torch
from torch import nn

from ...autograd.disentangled_attention import disentangled_attention
from ..modules import ORIGINAL_CLASS, swap
from .routes import ATTENTION_OPTIONS, CALLS, AttentionCalls, _count, count_forward

__all__ = ["disentangled_child", "DisentangledAttentionMixin", "verify_disentangled", "install"]

PROBE_BATCH, PROBE_SEQ = 2, 5
_METHODS = ("transpose_for_scores", "disentangled_attention_bias")


def _is_disentangled(module: nn.Module) -> bool:
    return (all(callable(getattr(module, m, None)) for m in _METHODS)
            and all(isinstance(getattr(module, p, None), nn.Linear) for p in ("query_proj", "key_proj", "value_proj"))
            and isinstance(getattr(module, "dropout", None), nn.Dropout)
            and isinstance(getattr(module, "num_attention_heads", None), int)
            and isinstance(getattr(module, "pos_att_type", None), (list, tuple)))


def disentangled_child(module: nn.Module):
    """(name, child) of the disentangled self-attention inside a transformers attention module, or None."""
    for name, child in module.named_children():
        if _is_disentangled(child):
            return name, child
    return None


def _positions(module, relative_pos):
    """relative_pos as (1, 1, S, S) longs, or None when the core cannot take it (per-batch positions)."""
    if relative_pos is None:
        return None
    if relative_pos.dim() == 2:
        relative_pos = relative_pos.unsqueeze(0).unsqueeze(0)
    elif relative_pos.dim() == 3:
        relative_pos = relative_pos.unsqueeze(1)
    if relative_pos.dim() != 4 or relative_pos.size(0) != 1 or relative_pos.size(1) != 1:
        return None
    return relative_pos.to(dtype=torch.long)


def _unsupported(module, attention_mask, output_attentions, query_states, relative_pos,
                 rel_embeddings) -> str | None:
    if output_attentions:
        return "output_attentions=True (the probabilities are returned)"
    if query_states is not None:
        return "query_states given (queries from another input)"
    if attention_mask is None:
        return "no attention mask given"
    if module.relative_attention and (relative_pos is None or rel_embeddings is None):
        return "relative positions not given by the encoder"
    if module.relative_attention and _positions(module, relative_pos) is None:
        return "relative positions per batch element"
    return None


class DisentangledAttentionMixin:
    """The disentangled attention through slimfit's core whenever a graph is built."""

    def forward(self, hidden_states, attention_mask, output_attentions=False, query_states=None,
                relative_pos=None, rel_embeddings=None):
        original = vars(self)[ORIGINAL_CLASS]
        args = (hidden_states, attention_mask, output_attentions, query_states, relative_pos, rel_embeddings)
        if not torch.is_grad_enabled():
            return original.forward(self, *args)
        count_forward(self)
        why = _unsupported(self, attention_mask, output_attentions, query_states, relative_pos, rel_embeddings)
        if why is not None:
            _count(self, why)
            return original.forward(self, *args)
        heads = self.num_attention_heads
        q = self.transpose_for_scores(self.query_proj(hidden_states), heads)
        k = self.transpose_for_scores(self.key_proj(hidden_states), heads)
        v = self.transpose_for_scores(self.value_proj(hidden_states), heads)
        kinds = self.pos_att_type
        scale = torch.sqrt(torch.tensor(q.size(-1), dtype=torch.float) * (1 + ("c2p" in kinds) + ("p2c" in kinds)))
        pos_key = pos_query = positions = None
        span = 0
        if self.relative_attention:
            span = self.pos_ebd_size
            rel = self.pos_dropout(rel_embeddings)[0: span * 2, :].unsqueeze(0)
            positions = _positions(self, relative_pos).to(q.device)
            if "c2p" in kinds:
                proj = self.key_proj if self.share_att_key else self.pos_key_proj
                pos_key = self.transpose_for_scores(proj(rel), heads)
            if "p2c" in kinds:
                proj = self.query_proj if self.share_att_key else self.pos_query_proj
                pos_query = self.transpose_for_scores(proj(rel), heads)
        dropout_p = self.dropout.p if self.training else 0.0
        out = disentangled_attention(q, k, v, pos_key, pos_query, positions, attention_mask, span, scale, heads,
                                     dropout_p, vars(self)[ATTENTION_OPTIONS])
        _count(self)
        out = out.view(-1, heads, out.size(-2), out.size(-1)).permute(0, 2, 1, 3).contiguous()
        return out.view(out.size()[:-2] + (-1,)), None


def _probe(module):
    """Hidden states, mask (the last key of the second row masked), relative positions and embeddings."""
    weight = module.query_proj.weight
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype=weight.dtype, device=weight.device)

    hidden = rand(PROBE_BATCH, PROBE_SEQ, weight.shape[1])
    mask = torch.ones(PROBE_BATCH, 1, PROBE_SEQ, PROBE_SEQ, dtype=torch.long, device=weight.device)
    mask[1, :, :, -1] = 0
    mask[1, :, -1, :] = 0
    if not module.relative_attention:
        return hidden, mask, None, None
    ids = torch.arange(PROBE_SEQ, device=weight.device)
    relative_pos = (ids[:, None] - ids[None, :]).unsqueeze(0)
    return hidden, mask, relative_pos, rand(2 * module.pos_ebd_size, weight.shape[1])


def verify_disentangled(module) -> str | None:
    """None when the patched module's forward (dropout off) equals its own bit for bit on the probe."""
    original = vars(module)[ORIGINAL_CLASS]
    hidden, mask, relative_pos, rel = _probe(module)
    training = module.training
    module.eval()
    try:
        with torch.no_grad():
            expected = original.forward(module, hidden, mask, False, None, relative_pos, rel)[0]
        with torch.enable_grad():
            got = module(hidden.detach().requires_grad_(True), mask, False, None, relative_pos, rel)[0]
        same = got.dtype == expected.dtype and torch.equal(got.detach(), expected)
    except Exception as exc:  # noqa: BLE001 - a forward that cannot run on the probe is not taken
        return f"disentangled-attention-shaped, but slimfit's core fails on a probe ({type(exc).__name__}): left as is"
    finally:
        module.train(training)
    vars(module)[CALLS].reached = vars(module)[CALLS].forwards = 0   # the probe is not a training call
    if same:
        return None
    return "disentangled-attention-shaped, but slimfit's core differs from its forward on a probe: left as is"


def install(module, options) -> None:
    """Swap the class and set the attention options and call counter (the caller checks verify)."""
    swap(module, DisentangledAttentionMixin, None)
    setattr(module, ATTENTION_OPTIONS, options)
    setattr(module, CALLS, AttentionCalls())
