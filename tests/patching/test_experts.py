"""Fused mixture-of-experts layers (Mixtral, Qwen3-MoE): recognised by structure, verified by the probe,
outputs bit-identical, gradients as close as the saved format allows, frozen experts keeping less."""
from __future__ import annotations

import warnings

import pytest
import torch

import slimfit
from slimfit import SlimFitConfig
from slimfit.memory import measure

from .decoder_zoo import build_decoder

MOE = ["mixtral", "qwen3_moe"]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _expert_grads(model, ids):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if ".experts." in n}


def _errors(got: dict, want: dict) -> list:
    return [float((got[n] - g).norm() / g.norm()) for n, g in want.items()]


@pytest.mark.parametrize("name", MOE)
def test_experts_patched_with_same_loss_and_bounded_gradient_error(name):
    model, ids = build_decoder(name)
    model.train()
    loss, plain = _expert_grads(model, ids)
    errors = {}
    for bits in (4, 8):
        # the chunked LM loss sums in another order (last-bit differences): left out to compare the experts
        slimfit.patch(model, SlimFitConfig.paper().replace(silu_bits=bits, lm_head_chunk_rows=None))
        assert sum(kind == "experts" for _, kind, _ in model.slimfit_summary.patched) == 2
        patched_loss, grads = _expert_grads(model, ids)
        assert torch.equal(patched_loss, loss)  # the forward is exact
        errors[bits] = max(_errors(grads, plain))
        slimfit.unpatch(model)
    # gate and up kept at 4 bits: about 10% relative error on these tiny experts; 8 bits: 16x finer codes
    assert errors[4] < 0.2 and errors[8] < errors[4] / 8


@pytest.mark.parametrize("name", MOE)
def test_frozen_experts_keep_less_than_plain_and_than_trainable(name):
    model, ids = build_decoder(name)
    model.train()
    for param_name, param in model.named_parameters():
        param.requires_grad_(".experts." in param_name or "embed" in param_name)
    experts = [n for n, _ in model.named_modules() if n.endswith(".experts")]

    def kept() -> int:
        run = measure(model, ids, labels=ids)
        return sum(bytes_ for module, bytes_ in run.per_module.items() if module.startswith(tuple(experts)))

    slimfit.patch(model, SlimFitConfig.paper())
    trainable = kept()
    for param_name, param in model.named_parameters():
        if ".experts." in param_name:
            param.requires_grad_(False)
    frozen = kept()
    slimfit.unpatch(model)
    plain_frozen = kept()
    # frozen: the projections keep nothing; what is left is the gated product's codes and the routing
    # product's rows (each expert's output rows, 8-bit: PyTorch keeps them in full)
    assert frozen < trainable and frozen < plain_frozen
    slimfit.patch(model, SlimFitConfig.paper().replace(ffn_out_input_bits=None))
    rows_in_full = kept()
    slimfit.unpatch(model)
    assert frozen < rows_in_full


@pytest.mark.parametrize("name", MOE)
def test_router_gradient_through_the_8bit_routed_rows(name):
    """The routing weights' gradient reads the routed rows, saved 8-bit: close to PyTorch's, and exactly
    PyTorch's with the rows in full (the experts frozen, so nothing else in the layer is compressed there
    but the gated product, which the router's gradient also reads: both formats bound it)."""
    model, ids = build_decoder(name)
    model.train()
    for param_name, param in model.named_parameters():
        param.requires_grad_(".experts." not in param_name)
    router = [n for n, p in model.named_parameters() if p.requires_grad and (".gate." in n or ".router." in n)]
    assert router

    def grads():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if n in router}

    plain = grads()
    errors = {}
    for bits in (8, None):
        slimfit.patch(model, SlimFitConfig.paper().replace(ffn_out_input_bits=bits, silu_bits=8,
                                                           lm_head_chunk_rows=None))
        errors[bits] = max(_errors(grads(), plain))
        slimfit.unpatch(model)
    assert errors[8] < 0.05 and errors[None] <= errors[8]


def test_experts_whose_forward_differs_are_left_alone_with_the_difference():
    """A fused-experts module whose own forward is not the per-expert loop (here: a scaled output) fails the
    probe: left as it is, and the summary says by how much it differed."""
    model, ids = build_decoder("mixtral")
    experts = [m for n, m in model.named_modules() if n.endswith(".experts")]
    cls = type(experts[0])
    scaled = type("ScaledExperts", (cls,), {"forward": lambda self, *a: cls.forward(self, *a) * 1.001})
    for module in experts:
        module.__class__ = scaled
    slimfit.patch(model, SlimFitConfig.paper())
    left = [why for name, _, why in model.slimfit_summary.skipped if name.endswith(".experts")]
    assert len(left) == len(experts) and all("max |difference|" in why for why in left)
    assert not any(kind == "experts" for _, kind, _ in model.slimfit_summary.patched)


def test_a_probe_that_cannot_run_says_why():
    from slimfit.patching.structure import probe_verdict

    lin = torch.nn.Linear(4, 3)
    assert probe_verdict(lin, torch.nn.Linear, torch.randn(2, 4)) is None
    assert probe_verdict(lin, torch.nn.Linear, torch.randn(2, 5)).startswith("the probe raised RuntimeError")


def _qwen3_moe_experts(k: int = 8):
    """A Qwen3-MoE experts layer routing each token to 8 of 16 experts: at top-8 the per-token sum of the
    experts' outputs depends on its order, so transformers' eager and grouped_mm forwards differ (tested)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=k)
    torch.manual_seed(0)
    module = Qwen3MoeExperts(config)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.05)
    tokens = 64
    x = torch.randn(tokens, 256)
    index = torch.stack([torch.randperm(16)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k)
    return module, config, (x, index, weights)


def _patched_experts(module):
    holder = torch.nn.ModuleDict({"experts": module})
    slimfit.patch(holder, SlimFitConfig.paper())
    return holder, [kind for _, kind, _ in holder.slimfit_summary.patched]


def test_experts_follow_the_models_own_implementation_bit_for_bit():
    module, config, (x, index, weights) = _qwen3_moe_experts()
    plain = {}
    for kind in ("grouped_mm", "eager"):
        config._experts_implementation = kind
        plain[kind] = module(x, index, weights)
    assert not torch.equal(plain["grouped_mm"], plain["eager"])   # the two orders of the top-8 sum
    holder, kinds = _patched_experts(module)
    assert "experts" in kinds
    for kind in ("grouped_mm", "eager"):
        config._experts_implementation = kind
        got = module(x.requires_grad_(True), index, weights)
        assert torch.equal(got, plain[kind]), kind


def test_grouped_experts_keep_the_hidden_states_once_and_nothing_when_frozen():
    """grouped_mm: a trained gate_up keeps the hidden states once (PyTorch: once per routed expert, 8 here);
    frozen experts keep only the gated product's codes and the routed rows."""
    module, config, (x, index, weights) = _qwen3_moe_experts()
    config._experts_implementation = "grouped_mm"
    x.requires_grad_(True)

    def kept():
        return measure(lambda h: module(h, index, weights), x, backward=False).total

    plain = kept()
    _patched_experts(module)
    trained = kept()
    for p in module.parameters():
        p.requires_grad_(False)
    frozen = kept()
    hidden_once = x.numel() * 4
    assert frozen < trained < plain
    assert trained - frozen >= hidden_once            # the hidden states (once) and the down input
    assert plain - trained > 7 * hidden_once          # PyTorch's gathered rows, one per routed expert, are gone


def test_an_experts_implementation_slimfit_does_not_follow():
    """At patch time: left alone with the reason. Set after patching: the layer's own forward, with a warning."""
    module, config, (x, index, weights) = _qwen3_moe_experts(k=2)
    config._experts_implementation = "batched_mm"
    holder = torch.nn.ModuleDict({"experts": module})
    slimfit.patch(holder, SlimFitConfig.paper())
    (why,) = [why for name, _, why in holder.slimfit_summary.skipped if name == "experts"]
    assert "batched_mm" in why
    slimfit.unpatch(holder)
    config._experts_implementation = "grouped_mm"
    _patched_experts(module)
    config._experts_implementation = "batched_mm"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = module(x.requires_grad_(True), index, weights)
    assert any("batched_mm" in str(w.message) for w in caught)
    with torch.no_grad():
        expected = module(x, index, weights)    # no graph: the module's own forward
    assert torch.equal(got, expected)
