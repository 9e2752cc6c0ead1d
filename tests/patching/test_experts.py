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
