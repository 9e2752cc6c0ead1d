"""Every SlimFitConfig field, and every field of its parts (AttentionSaving, LinearSampling,
ExperimentalSaving; named 'attention.<field>', 'sampling.<field>', 'experimental.<field>'), is honoured:
changing it (from a config where it applies) changes what a training step saves, the gradients it gives, or
raises. A field added without a case here fails
`test_every_field_has_a_case`, so no option can be accepted and silently ignored."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import slimfit
from slimfit import AttentionSaving, LinearSampling, SlimFitConfig, memory
from slimfit.config import ExperimentalSaving
from tests.patching.tiny_models import BATCH, build

EXACT = SlimFitConfig.exact()
ATTENTION = EXACT.with_attention()
MATERIALIZE = ATTENTION.with_attention(path="materialize")
SAMPLED = SlimFitConfig.paper().with_sampling(method="wta_crs", ratio=0.5, min_rows=1)

# field -> (config it applies to, another valid value, the tiny model, what must change)
#   'bytes': saved-for-backward bytes of one training step; 'grads': the gradients of that step
CASES = {
    "linear_input_bits": (EXACT, 8, "bert", "bytes"),
    "ffn_out_input_bits": (EXACT, 8, "bert", "bytes"),
    "gelu_bits": (EXACT, 4, "bert", "bytes"),
    "silu_bits": (EXACT, 4, "llama", "bytes"),
    "layernorm": (EXACT, "int8", "bert", "bytes"),
    "layernorm_frozen": (EXACT, "int8", "bert-frozen-norms", "bytes"),
    "attention": (EXACT, AttentionSaving(), "bert", "bytes"),
    "attention.qkv_bits": (ATTENTION, 8, "bert", "bytes"),
    "attention.probs": (MATERIALIZE, "int8", "bert", "bytes"),
    "attention.path": (ATTENTION.with_attention(probs="int8"), "materialize", "bert-no-dropout", "bytes"),
    "dropout": (EXACT, "bitmask", "bert", "bytes"),
    "group_size": (EXACT.replace(gelu_bits=4), 32, "bert", "bytes"),
    # without dropout: stochastic=True also advances torch's generator once per forward (side seeds), which
    # would change dropout masks; here only the rounding of the 4-bit GELU input can change the gradients
    "stochastic": (EXACT.replace(gelu_bits=4), True, "bert-no-dropout", "grads"),
    "sampling": (SlimFitConfig.paper(), LinearSampling(), "bert", "grads"),
    "sampling.method": (SAMPLED, "crs", "bert", "grads"),
    "sampling.ratio": (SAMPLED, 0.2, "bert", "bytes"),
    "sampling.min_rows": (SAMPLED.with_sampling(ratio=0.05), 30, "bert", "bytes"),
    "sampling.targets": (SAMPLED, "all", "bert", "bytes"),
    "sampling.norms": (SAMPLED, "sample", "bert", "grads"),
    "lm_head_chunk_rows": (EXACT, 16, "llama", "bytes"),
    "check_finite": (EXACT.replace(gelu_bits=4), True, "bert-nan", "raises"),
    "experimental": (MATERIALIZE, ExperimentalSaving(topk_probs=True), "bert", "bytes"),
    "experimental.topk_norms": (EXACT, "trainable", "bert", "bytes"),
    "experimental.topk_probs": (MATERIALIZE, True, "bert", "bytes"),
    "experimental.keep_ratio": (EXACT.with_experimental(topk_norms="trainable"), 0.5, "bert", "bytes"),
    "experimental.dropout_on_v": (MATERIALIZE, True, "bert", "grads"),
}
PARTS = {"attention": AttentionSaving, "sampling": LinearSampling, "experimental": ExperimentalSaving}


def _get(config: SlimFitConfig, field: str):
    part, _, name = field.rpartition(".")
    return getattr(getattr(config, part) if part else config, name)


def _changed(config: SlimFitConfig, field: str, value) -> SlimFitConfig:
    part, _, name = field.rpartition(".")
    if not part:
        return config.replace(**{name: value})
    return getattr(config, f"with_{part}")(**{name: value})


def _step(config: SlimFitConfig, model_kind: str):
    """(saved bytes, gradients) of one seeded training step of a tiny model patched with `config`;
    or the exception the step raised."""
    family = "llama" if model_kind == "llama" else "bert"
    model, inputs = build(family)
    if model_kind == "bert-no-dropout":
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        model.config.attention_probs_dropout_prob = 0.0
    model = slimfit.patch(model, config)
    model.train()
    if model_kind == "bert-frozen-norms":
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.requires_grad_(False)
    if config.sampling is not None:
        inputs = {**inputs, "sample_ids": torch.arange(BATCH)}
    if model_kind == "bert-nan":  # a NaN reaching a compressed activation
        model.bert.embeddings.word_embeddings.weight.data[inputs["input_ids"][0, 0]] = float("nan")
    torch.manual_seed(0)
    run = memory.measure(model, **inputs)
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    model(**inputs).loss.backward()
    if config.sampling is not None:  # a second step: sampling by the norms cached on the first
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        model(**inputs).loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return run.total, grads


def test_every_field_has_a_case():
    fields = {f.name for f in dataclasses.fields(SlimFitConfig)}
    fields |= {f"{part}.{f.name}" for part, cls in PARTS.items() for f in dataclasses.fields(cls)}
    assert set(CASES) == fields


@pytest.mark.parametrize("field", sorted(CASES))
def test_field_changes_the_step(field):
    base, value, model_kind, what = CASES[field]
    assert _get(base, field) != value
    changed = _changed(base, field, value)
    assert _get(changed, field) == value
    if what == "raises":
        _step(base, model_kind)  # the unchecked step runs (NaN propagates silently)
        with pytest.raises(ValueError, match="NaN|Inf|non-finite"):
            _step(changed, model_kind)
        return
    bytes_0, grads_0 = _step(base, model_kind)
    bytes_1, grads_1 = _step(changed, model_kind)
    if what == "bytes":
        assert bytes_1 != bytes_0, f"{field}={value!r} saved the same {bytes_0} bytes"
    else:
        assert grads_1.shape != grads_0.shape or not torch.equal(grads_1, grads_0), \
            f"{field}={value!r} gave the same gradients"
