"""Every decoder of the zoo under every preset: slimfit never changes which branch the model's own code
takes (eval outputs bit-identical, the model's attention implementation unchanged), a position never
sees later tokens in training, exact() trains bit-identically, and the summary says which attention
calls reached slimfit."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import slimfit
from slimfit import SlimFitConfig

from .decoder_zoo import DECODERS, VOCAB, build_decoder

PRESETS = {"exact": SlimFitConfig.exact, "paper": SlimFitConfig.paper, "aggressive": SlimFitConfig.aggressive,
           "wta_crs": SlimFitConfig.wta_crs}
# Mixture-of-experts layers group tokens by expert, so plain PyTorch itself changes earlier positions in
# the last bits when one token is replaced (measured: at most 6e-8 on these tiny models); a position that
# sees a later token changes by about 1e-1.
MOE_GROUPING_NOISE = 1e-6
MOE = {"mixtral", "qwen3_moe"}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _patched(name: str, preset: str, implementation: str = "sdpa"):
    model, ids = build_decoder(name, implementation)
    model.eval()
    with torch.no_grad():
        plain_eval = model(ids).logits
    model.implementation_before_patch = model.config._attn_implementation
    slimfit.patch(model, PRESETS[preset]())
    return model, ids, plain_eval


def _logits_pair(model, ids):
    """Training-mode logits for `ids` and for `ids` with the last token replaced (same dropout seed)."""
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB
    torch.manual_seed(5)
    first = model(ids).logits
    torch.manual_seed(5)
    second = model(changed).logits
    return first[:, :-1], second[:, :-1]


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("name", list(DECODERS))
def test_eval_identical_and_training_causal(name, preset, implementation):
    model, ids, plain_eval = _patched(name, preset, implementation)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain_eval), "eval output changed by patching"
    model.train()
    first, second = _logits_pair(model, ids)
    if name in MOE:
        assert (first - second).abs().max() <= MOE_GROUPING_NOISE, "an earlier position saw the last token"
    else:
        assert torch.equal(first, second), "an earlier position saw the last token"
    assert model.config._attn_implementation == model.implementation_before_patch


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(DECODERS))
def test_summary_says_which_attention_calls_reached_slimfit(name, implementation):
    model, ids, _ = _patched(name, "paper", implementation)
    model.train()
    model(ids, labels=ids).loss.backward()
    summary = model.slimfit_summary
    calls = summary.attention_calls()
    text = str(summary)
    if calls["modules"]:
        assert calls["forwards"] == calls["modules"]
        for module_name, why in calls["not_reached"]:
            assert "NOT REACHED" in text and why in text, module_name
        assert calls["reached"] + len(calls["not_reached"]) >= calls["modules"]
    else:
        assert "<attention>" in [skipped[0] for skipped in summary.skipped] or summary.attention is None


@pytest.mark.parametrize("name", list(DECODERS))
def test_exact_trains_bit_identically(name):
    model, ids = build_decoder(name)
    for module in model.modules():  # exact()'s seeded dropout draws other masks than torch's, by design
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.train()
    torch.manual_seed(5)
    model(ids, labels=ids).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    slimfit.patch(model, SlimFitConfig.exact())
    torch.manual_seed(5)
    model(ids, labels=ids).loss.backward()
    patched = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert patched.keys() == plain.keys()
    for key, grad in plain.items():
        assert torch.equal(patched[key], grad), key


# Families whose logits are transformed in a way the chunked loss does not compute: it leaves them alone
# (Gemma2's final soft-capping it computes: softcap=).
LOGIT_TRANSFORMS = {"cohere": "logit_scale"}


@pytest.mark.parametrize("name", list(DECODERS))
def test_chunked_lm_loss_wherever_the_head_is_a_linear(name):
    model, ids = build_decoder(name)
    for module in model.modules():  # compare the loss path alone: no dropout draws
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.train()
    torch.manual_seed(5)  # functional dropout (OPT) draws the same masks in both runs
    own = model(ids, labels=ids).loss
    own.backward()
    head = model.get_output_embeddings().weight
    own_grad = head.grad.clone()
    model.zero_grad(set_to_none=True)
    slimfit.patch(model, dataclasses.replace(SlimFitConfig.exact(), lm_head_chunk_rows=7))
    torch.manual_seed(5)
    out = model(ids, labels=ids)
    chunked = [entry for entry in model.slimfit_summary.patched if entry[1] == "causal-lm loss"]
    if name in LOGIT_TRANSFORMS:
        assert not chunked and LOGIT_TRANSFORMS[name] in str(model.slimfit_summary)
        return
    assert chunked and out.logits is None
    torch.testing.assert_close(out.loss, own, rtol=1e-6, atol=0)
    out.loss.backward()
    torch.testing.assert_close(head.grad, own_grad, rtol=1e-5, atol=1e-7)
