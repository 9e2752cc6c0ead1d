"""The patch API as the ecosystem uses it: patch returns the model (summary on it or by a flag),
target_modules / exclude_modules, PEFT in either order, merge_and_unload, nested patching."""
import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import slimfit  # noqa: E402
from slimfit import SlimFitConfig  # noqa: E402

from .tiny_models import build  # noqa: E402

LORA = dict(r=4, target_modules=["query", "value"], lora_dropout=0.0)


def _slimfit_leftovers(model):
    """Every trace of a patch on the modules: classes, attributes, attention implementation."""
    found = []
    for name, m in model.named_modules():
        if type(m).__module__.startswith("slimfit"):
            found.append((name, type(m).__name__))
        found += [(name, k) for k in vars(m) if k.startswith("_slimfit") or k == "slimfit_summary"]
        cfg = getattr(m, "config", None)
        if "slimfit" in str(getattr(cfg, "_attn_implementation", "")):
            found.append((name, cfg._attn_implementation))
    return found


def test_patch_returns_the_model_and_the_summary_lives_on_it():
    model, _ = build("bert")
    out = slimfit.patch(model, SlimFitConfig.paper())
    assert out is model
    assert slimfit.patching.patch_summary(model) is model.slimfit_summary
    assert any(kind == "linear" for _, kind, _ in model.slimfit_summary.patched)
    again = slimfit.patch(model, SlimFitConfig.paper())
    summary = again.slimfit_summary
    assert again is model and summary is model.slimfit_summary
    slimfit.unpatch(model)
    assert slimfit.patching.patch_summary(model) is None and not _slimfit_leftovers(model)


def test_target_and_exclude_modules_names_and_regex():
    model, _ = build("bert")
    slimfit.patch(model, SlimFitConfig.paper(), target_modules=["layer.1"], exclude_modules=["intermediate.dense"])
    names = {n for n, _, _ in model.slimfit_summary.patched}
    assert names and all(n.startswith("bert.encoder.layer.1.") for n in names)
    assert "bert.encoder.layer.1.output.dense" in names
    assert "bert.encoder.layer.1.intermediate.dense" not in names
    assert type(model.bert.encoder.layer[0].output.dense) is torch.nn.Linear
    assert type(model.classifier) is torch.nn.Linear
    reasons = {(n, why) for n, _, why in model.slimfit_summary.skipped}
    assert ("classifier", "not in target_modules") in reasons
    assert ("bert.encoder.layer.1.intermediate.dense", "in exclude_modules") in reasons
    slimfit.unpatch(model)

    slimfit.patch(model, SlimFitConfig.exact(), target_modules=r".*\.(query|value)")
    kinds = {(n.rsplit(".", 1)[-1], kind) for n, kind, _ in model.slimfit_summary.patched}
    assert kinds == {("query", "linear"), ("value", "linear")}


@pytest.mark.parametrize("bad, error", [(3, TypeError), (["ok", 4], TypeError), ("(", ValueError), ([""], TypeError)])
def test_bad_module_filters_are_refused(bad, error):
    model, _ = build("bert")
    with pytest.raises(error, match="target_modules"):
        slimfit.patch(model, SlimFitConfig.exact(), target_modules=bad)
    assert not _slimfit_leftovers(model)


def test_peft_order_does_not_decide_what_is_compressed():
    peft = pytest.importorskip("peft")
    model, inputs = build("bert")
    config = SlimFitConfig.paper()
    peft_first = slimfit.patch(peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(**LORA)), config)
    patched = slimfit.patch(copy.deepcopy(model), config)
    wrapped = peft.get_peft_model(patched, peft.LoraConfig(**LORA))
    # the wrong order is not silent: the first forward names the adapters left uncompressed
    with pytest.warns(UserWarning, match=r"added to this model after slimfit.patch.*lora_A"):
        wrapped(**inputs)
    # patching the outer model again (same config) compresses what the other order compresses
    slimfit.patch(wrapped, config)
    assert sorted(wrapped.slimfit_summary.patched) == sorted(peft_first.slimfit_summary.patched)
    assert any(".lora_A." in n for n, _, _ in wrapped.slimfit_summary.patched)
    assert slimfit.patching.patch_summary(patched) is None  # the inner record was absorbed, nothing stale
    wrapped.eval(), peft_first.eval()
    a = slimfit.memory.measure(wrapped, **inputs)
    b = slimfit.memory.measure(peft_first, **inputs)
    assert a.total == b.total


def test_peft_training_moves_only_the_adapters_and_head():
    peft = pytest.importorskip("peft")
    model, inputs = build("bert")
    lora = peft.LoraConfig(**LORA, modules_to_save=["classifier"])
    wrapped = peft.get_peft_model(slimfit.patch(model, SlimFitConfig.paper()), lora)
    slimfit.patch(wrapped, SlimFitConfig.paper())
    before = {n: p.detach().clone() for n, p in wrapped.named_parameters()}
    opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2)
    wrapped.train()
    for _ in range(3):
        wrapped(**inputs).loss.backward()
        opt.step()
        opt.zero_grad()
    moved = {n for n, p in wrapped.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(".lora_" in n or "classifier" in n for n in moved), moved
    assert any(".lora_A." in n for n in moved) and any(".lora_B." in n for n in moved)


@pytest.mark.parametrize("order", ["peft_first", "patch_first"])
def test_merge_and_unload_then_unpatch_leaves_nothing(order):
    peft = pytest.importorskip("peft")
    model, inputs = build("bert")
    if order == "peft_first":
        wrapped = slimfit.patch(peft.get_peft_model(model, peft.LoraConfig(**LORA)), SlimFitConfig.paper())
    else:
        wrapped = peft.get_peft_model(slimfit.patch(model, SlimFitConfig.paper()), peft.LoraConfig(**LORA))
    merged = wrapped.merge_and_unload()
    assert _slimfit_leftovers(merged)  # merging keeps the patched layers (and slimfit's attention)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "not patched" would be a lie here
        slimfit.unpatch(merged)
    assert not _slimfit_leftovers(merged)
    assert merged.config._attn_implementation == "sdpa"
    merged.eval()
    with torch.no_grad():
        assert torch.isfinite(merged(**inputs).logits).all()


def test_patch_child_then_parent_then_unpatch_leaves_nothing_stale():
    model, inputs = build("bert")
    reference, _ = build("bert")
    child = model.bert.encoder.layer[0]
    slimfit.patch(child, SlimFitConfig.paper())
    slimfit.patch(model, SlimFitConfig.paper())
    patched = {n for n, _, _ in model.slimfit_summary.patched}
    fresh = {n for n, _, _ in slimfit.patch(reference, SlimFitConfig.paper()).slimfit_summary.patched}
    assert patched == fresh and "bert.encoder.layer.0.attention.self.query" in patched  # complete
    assert slimfit.patching.patch_summary(child) is None
    slimfit.unpatch(model)
    assert not _slimfit_leftovers(model)
    with pytest.raises(RuntimeError, match="another config"):
        slimfit.patch(child, SlimFitConfig.paper())
        slimfit.patch(model, SlimFitConfig.exact())


def test_patching_a_part_of_a_patched_model_is_refused():
    model, _ = build("bert")
    slimfit.patch(model, SlimFitConfig.paper())
    with pytest.raises(RuntimeError, match="already patched"):
        slimfit.patch(model.bert.encoder.layer[0], SlimFitConfig.paper())
    slimfit.unpatch(model.bert.encoder.layer[0])  # unpatching a part works (and says nothing)
    assert type(model.bert.encoder.layer[0].output.dense) is torch.nn.Linear
