"""Mixture-of-experts layers on a CUDA device in bf16 (run with: pytest -m gpu): transformers' grouped_mm experts
forward and slimfit's grouped path give the same output bit for bit, gradients as PyTorch's grouped_mm gives them
(in full) or at the dequantized point, and frozen experts keep only the gated product's codes and routed rows."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import slimfit
from slimfit import SlimFitConfig
from slimfit.autograd.grouped_linear import grouped_linear
from slimfit.memory import measure

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _qwen3_moe_experts(k: int = 8, dtype=torch.bfloat16):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=512, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=k)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    module = Qwen3MoeExperts(config)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.05)
    module = module.to("cuda", dtype)
    tokens = 256
    x = torch.randn(tokens, 512, device="cuda", dtype=dtype)
    index = torch.stack([torch.randperm(16)[:k] for _ in range(tokens)]).to("cuda")
    weights = torch.rand(tokens, k, device="cuda", dtype=dtype)
    return module, (x, index, weights)


def test_grouped_linear_in_full_equals_grouped_mm_on_cuda():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    w = torch.randn(4, 384, 256, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    counts = torch.tensor([40, 0, 50, 38])
    offsets = torch.cumsum(counts, 0).to("cuda", torch.int32)
    gather = (torch.randperm(128, generator=gen) % 64).to("cuda")
    out = grouped_linear(x, w, offsets, gather=gather)
    ref = F.grouped_mm(x[gather], w.transpose(-2, -1), offs=offsets)
    assert torch.equal(out, ref)
    g = torch.randn(out.shape, generator=gen).to(out)
    got, exp = torch.autograd.grad(out, [x, w], g), torch.autograd.grad(ref, [x, w], g)
    assert all(torch.equal(a, b) for a, b in zip(got, exp))


def test_patched_experts_follow_the_models_grouped_forward_on_cuda():
    module, (x, index, weights) = _qwen3_moe_experts()
    expected = module(x, index, weights)
    holder = torch.nn.ModuleDict({"experts": module})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        slimfit.patch(holder, SlimFitConfig.paper())
    assert any(kind == "experts" for _, kind, _ in holder.slimfit_summary.patched)
    got = module(x.requires_grad_(True), index, weights)
    assert torch.equal(got, expected)
    got.float().pow(2).mean().backward()   # gradients flow to the experts and the hidden states
    assert x.grad is not None and module.gate_up_proj.grad is not None and module.down_proj.grad is not None

    def kept():
        return measure(lambda h: module(h, index, weights), x, backward=False).total

    trained = kept()
    for p in module.parameters():
        p.requires_grad_(False)
    assert kept() < trained
