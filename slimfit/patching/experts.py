"""Mixture-of-experts layers whose experts are fused 3-D weights (transformers' `*Experts` modules:
`gate_up_proj` of shape (E, 2I, H), `down_proj` of shape (E, H, I), a SiLU `act_fn`; Mixtral, Qwen2/3-MoE,
OLMoE ...), computed through slimfit's linear and SwiGLU product.

Recognised by structure (`is_fused_experts`) and taken only when a patch-time probe, random hidden states
routed to random experts, gives output bit-identical to the module's own forward. Per expert hit, as the
module's own eager loop: its tokens' rows, gate_up, silu(gate) * up, down, times the routing weight, added
back. With the weights frozen (the scheduler freezes a parameter, so all experts of a layer at once) the
projections save nothing and compute no weight gradient; the gated product keeps gate and up quantized,
the routing product (output rows times routing weights) its rows at the FFN output side's bits.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import autograd
from ..autograd.silu import swiglu
from .modules import OPTIONS, ORIGINAL_CLASS
from .structure import probe_verdict

PROBE_TOKENS = 6


def is_fused_experts(module: nn.Module, silu_classes: tuple) -> bool:
    """3-D gate_up_proj (E, 2I, H) and down_proj (E, H, I) parameters, a SiLU act_fn, and (where the module
    declares its layout, as transformers' experts decorator does) concatenated, untransposed, bias-free,
    gated weights without a post-expert norm."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)):
        return False
    if gate_up.dim() != 3 or down.dim() != 3 or not isinstance(getattr(module, "act_fn", None), silu_classes):
        return False
    experts, two_inner, hidden = gate_up.shape
    if down.shape != (experts, hidden, two_inner // 2) or two_inner % 2:
        return False
    layout = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True,
              "has_post_expert_norm": False}
    return all(getattr(module, name, expected) == expected for name, expected in layout.items())


def _expert_rows(top_k_index: torch.Tensor, experts: int):
    """(expert, positions in top-k, token rows) for every expert some token is routed to."""
    with torch.no_grad():
        mask = nn.functional.one_hot(top_k_index, num_classes=experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
    for expert in hit:
        if expert == experts:  # the padding slot of the one-hot (index == E)
            continue
        positions, tokens = torch.where(mask[expert])
        yield expert, positions, tokens


class ExpertsMixin:
    """The experts' forward through slimfit's linear and SwiGLU product when a graph is built."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if not torch.is_grad_enabled():
            return vars(self)[ORIGINAL_CLASS].forward(self, hidden_states, top_k_index, top_k_weights)
        opts = getattr(self, OPTIONS)
        out = torch.zeros_like(hidden_states)
        for expert, positions, tokens in _expert_rows(top_k_index, self.gate_up_proj.shape[0]):
            rows = hidden_states[tokens]
            gate, up = autograd.linear(rows, self.gate_up_proj[expert], None, options=opts.gate_up).chunk(2, dim=-1)
            h = swiglu(gate, up, options=opts.product)
            y = autograd.linear(h, self.down_proj[expert], None, options=opts.down)
            out.index_add_(0, tokens, autograd.row_scale(y, top_k_weights[tokens, positions],
                                                         options=opts.routing).to(out.dtype))
        return out


def verify_experts(ctx, module) -> str | None:
    """The probe: random hidden states routed to random experts with random weights."""
    experts, _, hidden = module.gate_up_proj.shape
    like = module.gate_up_proj
    generator = torch.Generator().manual_seed(0)
    k = min(2, experts)
    x = torch.randn(PROBE_TOKENS, hidden, generator=generator).to(dtype=like.dtype, device=like.device)
    index = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(PROBE_TOKENS)]).to(like.device)
    weights = torch.rand(PROBE_TOKENS, k, generator=generator).to(dtype=like.dtype, device=like.device)
    original = vars(module)[ORIGINAL_CLASS]
    verdict = probe_verdict(module, original, x, index, weights)
    if verdict is None:
        return None
    return (f"fused-experts-shaped, but against the per-expert silu(gate) * up loop {verdict}: left as is")
