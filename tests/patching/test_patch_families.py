"""slimfit.patch on every supported family: exactness, gradients, state_dict, unpatch."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import slimfit  # noqa: E402
from slimfit import AttentionSaving, SlimFitConfig  # noqa: E402

from .tiny_models import FAMILIES, build  # noqa: E402


def _output(model, inputs):
    out = model(**inputs)
    return out.logits


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_outputs_are_bit_identical(family):
    model, inputs = build(family)
    patched = slimfit.patch(copy.deepcopy(model), SlimFitConfig.paper())
    model.eval(), patched.eval()
    with torch.no_grad():
        assert torch.equal(_output(model, inputs), _output(patched, inputs))


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_preset_gives_identical_gradients(family):
    model, inputs = build(family)
    patched = slimfit.patch(copy.deepcopy(model), SlimFitConfig.exact())
    summary = patched.slimfit_summary
    assert any(kind == "linear" for _, kind, _ in summary.patched)
    # eval mode: no dropout, so both runs are deterministic; gradients still flow
    model.eval(), patched.eval()
    # freeze half the linear weights: the frozen fast path must be exact too
    for m in (model, patched):
        for i, p in enumerate(m.parameters()):
            if p.dim() == 2 and i % 2 == 0:
                p.requires_grad_(False)
    model(**inputs).loss.backward()
    patched(**inputs).loss.backward()
    g0, g1 = _grads(model), _grads(patched)
    assert g0.keys() == g1.keys()
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


@pytest.mark.parametrize("family", FAMILIES)
def test_paper_preset_gradients_close(family):
    model, inputs = build(family)
    patched = slimfit.patch(copy.deepcopy(model), SlimFitConfig.paper().with_attention(probs="int8"))
    model.eval(), patched.eval()
    model(**inputs).loss.backward()
    patched(**inputs).loss.backward()
    g0, g1 = _grads(model), _grads(patched)
    flat0 = torch.cat([g.flatten() for g in g0.values()])
    flat1 = torch.cat([g1[n].flatten() for n in g0])
    cos = torch.nn.functional.cosine_similarity(flat0, flat1, dim=0).item()
    # 4-bit GELU inputs and 8-bit Q/K/V/P: the whole gradient keeps its direction
    assert cos > 0.99, cos


@pytest.mark.parametrize("family", ["bert", "vit", "gpt2", "llama"])
def test_state_dict_unpatch_and_save_pretrained(family, tmp_path):
    model, inputs = build(family)
    reference = copy.deepcopy(model)
    params_before = {n: p for n, p in model.named_parameters()}
    classes_before = {n: type(m) for n, m in model.named_modules()}
    slimfit.patch(model, SlimFitConfig.paper())
    assert {n: p for n, p in model.named_parameters()} == params_before  # same objects
    sd = model.state_dict()
    ref_sd = reference.state_dict()
    assert sd.keys() == ref_sd.keys()
    assert all(torch.equal(sd[k], ref_sd[k]) for k in sd)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], ref_sd[k]) for k in ref_sd)
    slimfit.unpatch(model)
    assert {n: type(m) for n, m in model.named_modules()} == classes_before
    model.eval(), reference.eval()
    with torch.no_grad():
        assert torch.equal(_output(model, inputs), _output(reference, inputs))


def test_patch_twice_is_idempotent_or_clear_error():
    model, _ = build("bert")
    s1 = slimfit.patch(model, SlimFitConfig.paper()).slimfit_summary
    s2 = slimfit.patch(model, SlimFitConfig.paper()).slimfit_summary
    assert s1.patched == s2.patched and s1.skipped == s2.skipped  # re-patched: the same, complete
    assert model.slimfit_summary is s2
    with pytest.raises(RuntimeError, match="unpatch"):
        slimfit.patch(model, SlimFitConfig.exact())


def test_summary_names_what_was_left_alone():
    model, _ = build("llama")
    summary = slimfit.patch(model, SlimFitConfig.paper()).slimfit_summary
    text = str(summary)
    assert "rmsnorm" in text and "swiglu" in text and "linear" in text
    assert summary.attention == "sdpa" and model.config._attn_implementation == "sdpa"  # the model's own, unchanged
    summary = slimfit.patch(build("llama")[0], SlimFitConfig.exact()).slimfit_summary
    text = str(summary)
    assert "LlamaRMSNorm: layernorm saves in full" in text and "LlamaMLP: silu_bits=None" in text


def test_to_half_and_train_eval_after_patch():
    model, inputs = build("bert")
    slimfit.patch(model, SlimFitConfig.paper())
    model.train()
    model.eval()
    model.half()
    assert all(p.dtype == torch.float16 for p in model.parameters())


def test_config_errors():
    with pytest.raises(ValueError, match="gelu_bits"):
        SlimFitConfig(gelu_bits=3)
    with pytest.raises(ValueError, match="AttentionSaving.probs"):
        SlimFitConfig(attention=AttentionSaving(probs="int3"))
    with pytest.raises(TypeError, match="qkv_bits"):  # a field of AttentionSaving, not of the config
        SlimFitConfig(qkv_bits=8)
    with pytest.raises(ValueError, match="keep_ratio"):
        SlimFitConfig().with_experimental(keep_ratio=0)
    with pytest.raises(TypeError, match="SlimFitConfig"):
        slimfit.patch(torch.nn.Linear(2, 2), {"gelu_bits": 4})
