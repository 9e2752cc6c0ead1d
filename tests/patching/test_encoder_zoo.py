"""Every encoder, vision model and encoder-decoder of the zoo: eval outputs bit-identical under every
preset, exact() gradients bit-identical, and the summary says which attention calls reached slimfit."""
from __future__ import annotations

import warnings

import pytest
import torch

import slimfit
from slimfit import SlimFitConfig

from .encoder_zoo import MODELS, build_model

PRESETS = {"exact": SlimFitConfig.exact, "paper": SlimFitConfig.paper, "aggressive": SlimFitConfig.aggressive,
           "wta_crs": SlimFitConfig.wta_crs}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _without_dropout(model):
    for module in model.modules():  # exact()'s seeded dropout draws other masks than torch's, by design
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("name", list(MODELS))
def test_eval_outputs_identical(name, preset):
    model, inputs = build_model(name)
    model.eval()
    with torch.no_grad():
        plain = model(**inputs).logits
    slimfit.patch(model, PRESETS[preset]())
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, plain)


@pytest.mark.parametrize("name", list(MODELS))
def test_exact_trains_bit_identically(name):
    model, inputs = build_model(name)
    _without_dropout(model).train()
    torch.manual_seed(5)
    model(**inputs).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    slimfit.patch(model, SlimFitConfig.exact())
    torch.manual_seed(5)
    model(**inputs).loss.backward()
    patched = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert patched.keys() == plain.keys()
    for key, grad in plain.items():
        assert torch.equal(patched[key], grad), key


@pytest.mark.parametrize("name", list(MODELS))
def test_summary_says_which_attention_calls_reached_slimfit(name):
    model, inputs = build_model(name)
    slimfit.patch(model, SlimFitConfig.paper())
    model.train()
    model(**inputs).loss.backward()
    summary = model.slimfit_summary
    text = str(summary)
    for module_name, module in summary.attention_modules:
        calls = vars(module)["_slimfit_attention_calls"]
        assert calls.forwards > 0, module_name
        if not calls.reached:  # a module that ran without reaching slimfit is named, with the reason
            not_reached = dict(summary.attention_calls()["not_reached"])
            assert module_name in not_reached and "NOT REACHED" in text and not_reached[module_name] in text
