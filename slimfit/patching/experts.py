"""Mixture-of-experts layers whose experts are fused 3-D weights (transformers' `*Experts` modules:
`gate_up_proj` of shape (E, 2I, H), `down_proj` of shape (E, H, I), a SiLU `act_fn`; Mixtral, Qwen2/3-MoE,
OLMoE ...), computed through slimfit's linears and SwiGLU product.

The forward follows the module's own experts implementation (`config._experts_implementation`), so that the
output is bit-identical to it at every size, not only on the probe:
  "grouped_mm" (transformers' default): the token-expert pairs sorted by expert, each projection one grouped
               GEMM (slimfit.autograd.grouped_linear, with the model's own grouped GEMM), the top-k outputs
               summed per token; a trained gate_up keeps the hidden states once, not once per expert;
  "eager":     per expert hit, its tokens' rows, gate_up, silu(gate) * up, down, times the routing weight,
               added back.
Another implementation (set after patching) runs the module's own forward, saving what PyTorch saves, with a
warning. Recognised by structure (`is_fused_experts`) and taken only when a patch-time probe, random hidden
states routed to random experts, gives output bit-identical to the module's own forward. With the weights
frozen (the scheduler freezes a parameter, so all experts of a layer at once) the projections save nothing
and compute no weight gradient; the gated product keeps gate and up quantized, the routing product (output
rows times routing weights) its rows at the FFN output side's bits.
"""
from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from .. import autograd
from ..autograd.grouped_linear import grouped_linear
from ..autograd.silu import swiglu
from .modules import OPTIONS, ORIGINAL_CLASS
from .structure import probe_verdict

PROBE_TOKENS = 6
FOLLOWED = ("eager", "grouped_mm")  # the experts implementations this forward reproduces


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
              "has_post_expert_norm": False, "_is_expert_parallel": False}
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


def implementation(module: nn.Module) -> str:
    """The module's experts implementation: its config's `_experts_implementation` ("eager" without one)."""
    return getattr(getattr(module, "config", None), "_experts_implementation", None) or "eager"


@functools.cache
def model_grouped_linear():
    """transformers' grouped linear (what its grouped_mm experts forward multiplies with), or None (looked up
    once: every experts forward uses it)."""
    try:
        from transformers.integrations.moe import _grouped_linear
    except ImportError:
        return None
    return lambda rows, weight_t, offsets: _grouped_linear(rows, weight_t, offsets, is_transposed=True)


class ExpertsMixin:
    """The experts' forward through slimfit's linears and SwiGLU product when a graph is built, in the
    module's own experts implementation (see the module docstring)."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        original = vars(self)[ORIGINAL_CLASS].forward
        if not torch.is_grad_enabled():
            return original(self, hidden_states, top_k_index, top_k_weights)
        kind = implementation(self)
        if kind == "grouped_mm":
            return self._grouped_forward(hidden_states, top_k_index, top_k_weights)
        if kind == "eager":
            return self._eager_forward(hidden_states, top_k_index, top_k_weights)
        warnings.warn(f"slimfit: experts implementation {kind!r} set after patching: this layer runs its own "
                      f"forward and saves what PyTorch saves (slimfit follows {FOLLOWED})", stacklevel=2)
        return original(self, hidden_states, top_k_index, top_k_weights)

    def _eager_forward(self, hidden_states, top_k_index, top_k_weights):
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

    def _grouped_forward(self, hidden_states, top_k_index, top_k_weights):
        opts = getattr(self, OPTIONS)
        mm = model_grouped_linear()
        tokens, k = top_k_index.shape
        experts = self.gate_up_proj.shape[0]
        with torch.no_grad():
            expert_of_pair, order = torch.sort(top_k_index.reshape(-1))
            # histc counts floats on the CPU (and MPS), integers elsewhere, as the model's own forward
            counted = expert_of_pair.float() if hidden_states.device.type in ("cpu", "mps") else expert_of_pair.int()
            offsets = torch.cumsum(torch.histc(counted, bins=experts, min=0, max=experts - 1), 0, dtype=torch.int32)
            unsort = torch.empty_like(order)
            unsort[order] = torch.arange(order.numel(), device=order.device)
        gate_up = grouped_linear(hidden_states, self.gate_up_proj, offsets, gather=order // k, mm=mm,
                                 options=opts.gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        h = swiglu(gate, up, options=opts.product)
        y = grouped_linear(h, self.down_proj, offsets, mm=mm, options=opts.down)
        weighted = autograd.row_scale(y, top_k_weights.reshape(-1)[order], options=opts.routing)
        out = weighted[unsort].view(tokens, k, -1).sum(dim=1)
        return out.to(hidden_states.dtype)


def verify_experts(ctx, module) -> str | None:
    """The probe: random hidden states routed to random experts with random weights, in the module's own
    experts implementation (one slimfit does not follow is left alone)."""
    kind = implementation(module)
    if kind not in FOLLOWED:
        return f"fused-experts-shaped, but its experts implementation is {kind!r} (slimfit follows {FOLLOWED})"
    if kind == "grouped_mm" and model_grouped_linear() is None:
        return "fused-experts-shaped with grouped_mm experts, but this transformers has no grouped linear to follow"
    experts, _, hidden = module.gate_up_proj.shape
    like = module.gate_up_proj
    generator = torch.Generator().manual_seed(0)
    # the model's own top-k: the per-token sum of k outputs is where implementations differ (k > 2)
    k = min(int(getattr(getattr(module, "config", None), "num_experts_per_tok", 2) or 2), experts)
    x = torch.randn(PROBE_TOKENS, hidden, generator=generator).to(dtype=like.dtype, device=like.device)
    index = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(PROBE_TOKENS)]).to(like.device)
    weights = torch.rand(PROBE_TOKENS, k, generator=generator).to(dtype=like.dtype, device=like.device)
    original = vars(module)[ORIGINAL_CLASS]
    verdict = probe_verdict(module, original, x, index, weights)
    if verdict is None:
        return None
    return f"fused-experts-shaped, but against its {kind} experts forward {verdict}: left as is"
