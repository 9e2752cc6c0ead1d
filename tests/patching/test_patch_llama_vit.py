"""Llama-family activations (SwiGLU product, RMSNorm) and the ViT patch-embedding conv through slimfit.patch:
forward bit-exact, exact() gradients identical, byte-exact saved sizes, summary reasons."""
import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

import slimfit  # noqa: E402
from slimfit import SlimFitConfig, memory  # noqa: E402
from slimfit.autograd.layernorm import topk_keep  # noqa: E402

from .tiny_models import BATCH, SEQ, build  # noqa: E402

LLAMAS = ["llama", "mistral", "qwen2"]
HIDDEN, INTER = 32, 64  # tiny_models' Llama sizes


def q_bytes(numel, bits, group_size=128):
    return math.ceil(numel * bits / 8) + 8 * math.ceil(numel / group_size)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _freeze_all(model):
    for p in model.parameters():
        p.requires_grad_(False)


# SwiGLU + RMSNorm only (attention left to PyTorch), so the whole forward must be bit-exact
ACTIVATIONS_ONLY = SlimFitConfig(silu_bits=4, layernorm="int8").with_experimental(topk_norms="frozen")


@pytest.mark.parametrize("family", LLAMAS)
def test_training_forward_bit_exact_and_summary(family):
    model, inputs = build(family)
    patched = slimfit.patch(copy.deepcopy(model), ACTIVATIONS_ONLY)
    summary = patched.slimfit_summary
    counts = summary.counts()
    assert counts["swiglu[gate and up 4-bit]"] == 2
    assert counts["rmsnorm[int8/topk when frozen]"] == 5  # 2 per layer + the final norm
    assert not any("SiLU" in cls or "RMSNorm" in cls for _, cls, _ in summary.skipped)
    model.train(), patched.train()
    out, ref = patched(**inputs), model(**inputs)  # grad enabled: the compressed Functions run
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    out.loss.backward(), ref.loss.backward()
    g0, g1 = _grads(model), _grads(patched)
    flat0 = torch.cat([g.flatten() for g in g0.values()])
    flat1 = torch.cat([g1[n].flatten() for n in g0])
    assert torch.nn.functional.cosine_similarity(flat0, flat1, dim=0) > 0.999


@pytest.mark.parametrize("family", LLAMAS)
def test_exact_leaves_swiglu_and_rmsnorm_alone(family):
    model, _ = build(family)
    summary = slimfit.patch(model, SlimFitConfig.exact()).slimfit_summary
    reasons = {(cls, reason) for _, cls, reason in summary.skipped}
    mlp = f"{'Qwen2' if family == 'qwen2' else family.capitalize()}MLP"
    norm = mlp.replace("MLP", "RMSNorm")
    assert (mlp, "silu_bits=None (SwiGLU product saved as in PyTorch)") in reasons
    assert (norm, "layernorm saves in full (RMSNorm saved as in PyTorch)") in reasons
    assert "swiglu" not in str(summary) and "rmsnorm" not in str(summary)


def test_saved_bytes_per_module_are_byte_exact():
    """All weights frozen (no linear saves anything): the MLP module keeps gate and up at 4 bits,
    each RMSNorm x̂ at int8 (paper()) or its top-10% (fp32 values + int16 indices), + fp32 rstd per row;
    plain PyTorch keeps
    gate, silu(gate), up (3 full tensors) and x (twice: fp32 copy and x̂) + rstd."""
    model, inputs = build("llama")
    model.eval()  # deterministic
    plain = memory.measure(model, **inputs)
    no_attention = SlimFitConfig.paper().replace(attention=None)
    patched = slimfit.patch(copy.deepcopy(model), no_attention)
    _freeze_all(patched)
    inputs_embeds = patched.get_input_embeddings()(inputs["input_ids"]).detach().requires_grad_()
    run = memory.measure(patched, inputs_embeds=inputs_embeds, labels=inputs["labels"])
    rows, n_inter = BATCH * SEQ, BATCH * SEQ * INTER
    for name in ("model.layers.0.input_layernorm", "model.layers.1.post_attention_layernorm"):
        assert run.per_module[name] == q_bytes(rows * HIDDEN, 8) + 4 * rows
    patched = slimfit.patch(copy.deepcopy(model), no_attention.with_experimental(topk_norms="frozen"))
    _freeze_all(patched)
    run = memory.measure(patched, inputs_embeds=inputs_embeds, labels=inputs["labels"])
    assert run.per_module["model.layers.0.mlp"] == 2 * q_bytes(n_inter, 4)
    assert run.per_module.get("model.layers.0.mlp.act_fn", 0) == 0
    assert plain.per_module["model.layers.0.mlp"] + plain.per_module["model.layers.0.mlp.act_fn"] == 3 * n_inter * 4
    for name in ("model.layers.0.input_layernorm", "model.layers.1.post_attention_layernorm"):
        assert run.per_module[name] == rows * topk_keep(0.1, HIDDEN) * (4 + 2) + 4 * rows
    # plain: x fp32 (pow, mul) + rstd + x̂ (the product with the weight)
    assert plain.per_module["model.layers.1.input_layernorm"] == 2 * rows * HIDDEN * 4 + 4 * rows
    # trainable norm weight: x̂ at int8 ('layernorm' = 'int8' in paper()) + rstd; in full with layernorm='full'
    patched.model.norm.weight.requires_grad_(True)
    run = memory.measure(patched, inputs_embeds=inputs_embeds, labels=inputs["labels"])
    assert run.per_module["model.norm"] == q_bytes(rows * HIDDEN, 8) + 4 * rows
    full_norm = slimfit.patch(copy.deepcopy(model), no_attention.replace(layernorm="full"))
    _freeze_all(full_norm)
    full_norm.model.norm.weight.requires_grad_(True)
    run = memory.measure(full_norm, inputs_embeds=inputs_embeds, labels=inputs["labels"])
    assert run.per_module["model.norm"] == rows * HIDDEN * 4 + 4 * rows


def test_paper_with_frozen_layers_saves_several_times_less():
    model, inputs = build("llama")
    model.eval()
    plain = memory.measure(model, **inputs)
    patched = slimfit.patch(copy.deepcopy(model), SlimFitConfig.paper())
    for n, p in patched.named_parameters():  # freeze all but the last layer's weights
        if "layers.1." not in n:
            p.requires_grad_(False)
    slim = memory.measure(patched, **inputs)
    assert slim.total * 3 < plain.total, (plain.total, slim.total)


def test_gelu_gated_mlp_is_a_geglu():
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, hidden_act="gelu")
    model = transformers.LlamaForCausalLM(cfg)
    summary = slimfit.patch(model, SlimFitConfig.paper()).slimfit_summary
    assert summary.counts().get("geglu[gate and up 4-bit (GELU none)]") == 1
    assert "swiglu" not in str(summary) and "gelu[" not in str(summary)  # its activation is the MLP's


def test_other_gated_mlp_is_left_alone_and_said_so():
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, hidden_act="relu")
    model = transformers.LlamaForCausalLM(cfg)
    summary = slimfit.patch(model, SlimFitConfig.paper()).slimfit_summary
    reasons = [reason for _, cls, reason in summary.skipped if cls == "LlamaMLP"]
    assert reasons and "act_fn is ReLU, not SiLU" in reasons[0]
    assert summary.counts().get("relu[1-bit mask (exact)]") == 1  # its activation is patched on its own
    assert "swiglu" not in str(summary)


def test_generic_silu_module():
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.SiLU(), torch.nn.Linear(64, 4))
    ref = copy.deepcopy(model)
    summary = slimfit.patch(model, SlimFitConfig.paper()).slimfit_summary
    assert summary.counts()["silu[4-bit input]"] == 1
    x = torch.randn(8, 16)
    assert torch.equal(model(x), ref(x))
    model[0].weight.requires_grad_(False)
    assert memory.measure(model, x, loss_fn=lambda out: out.sum()).per_module["1"] == q_bytes(8 * 64, 4)
    summary = slimfit.patch(torch.nn.Sequential(torch.nn.SiLU()), SlimFitConfig.exact()).slimfit_summary
    assert summary.skipped == [("0", "SiLU", "silu_bits=None")]


def test_unknown_rmsnorm_variant_is_reported():
    class GemmaLikeRMSNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(8))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)

    summary = slimfit.patch(torch.nn.Sequential(GemmaLikeRMSNorm()), SlimFitConfig.paper()).slimfit_summary
    assert summary.skipped[0][1] == "GemmaLikeRMSNorm" and "does not know" in summary.skipped[0][2]


# ------------------------------------------------------------------ ViT patch-embedding conv
@pytest.mark.parametrize("family", ["vit", "dinov2"])
def test_frozen_patch_embedding_saves_nothing_and_exact_gradients(family):
    model, inputs = build(family)
    patched = slimfit.patch(copy.deepcopy(model), SlimFitConfig.exact())
    summary = patched.slimfit_summary
    assert summary.counts()["conv[frozen fast path (trainable: as PyTorch)]"] == 1
    model.eval(), patched.eval()
    for m in (model, patched):
        m.get_submodule(f"{family}.embeddings.patch_embeddings.projection").weight.requires_grad_(False)
        for i, p in enumerate(m.parameters()):
            if p.dim() == 2 and i % 2 == 0:
                p.requires_grad_(False)
    conv = f"{family}.embeddings.patch_embeddings.projection"
    plain, slim = memory.measure(model, **inputs), memory.measure(patched, **inputs)
    assert plain.per_module[conv] == inputs["pixel_values"].numel() * 4  # PyTorch keeps the pixels (bias trains)
    assert slim.per_module.get(conv, 0) == 0
    model.zero_grad(), patched.zero_grad()
    model(**inputs).loss.backward()
    patched(**inputs).loss.backward()
    g0, g1 = _grads(model), _grads(patched)
    assert g0.keys() == g1.keys() and f"{conv}.bias" in g0
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


def test_trainable_conv_is_pytorch_and_unpatch_restores():
    model, inputs = build("vit")
    patched = slimfit.patch(copy.deepcopy(model), SlimFitConfig.paper())
    conv = "vit.embeddings.patch_embeddings.projection"
    model.eval(), patched.eval()
    assert memory.measure(patched, **inputs).per_module[conv] == memory.measure(model, **inputs).per_module[conv]
    slimfit.unpatch(patched)
    assert type(patched.get_submodule(conv)) is torch.nn.Conv2d


def test_llama_activation_checkpointing():
    """Non-reentrant activation checkpointing recomputes the compressed Functions: same gradients.
    (bf16 autocast: test_patch_training.test_autocast_bf16_training_step.)"""
    model, inputs = build("llama")
    patched = slimfit.patch(model, ACTIVATIONS_ONLY)
    twin = copy.deepcopy(patched)
    twin.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    patched.train(), twin.train()
    patched(**inputs).loss.backward()
    twin(**inputs).loss.backward()
    for (n, p), (_, q) in zip(patched.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)


def _modernbert_mlp(dropout: float = 0.0):
    from .encoder_zoo import build_model

    model, inputs = build_model("modernbert")
    for layer in model.model.layers:
        layer.mlp.drop.p = dropout
    return model, inputs


def test_fused_gelu_gated_mlp_recognised_by_structure():
    """ModernBERT's MLP (Wi -> [input, gate], GELU, dropout, Wo: no gate_proj / up_proj names) is a fused GeGLU
    by structure: patched, gate and up saved at 4 bits, its forward bit-identical to the original's; its
    gradients those of the plain model within the 4-bit error."""
    model, inputs = _modernbert_mlp()
    ref = copy.deepcopy(model)
    summary = slimfit.patch(model, SlimFitConfig.paper().replace(attention=None)).slimfit_summary
    assert summary.counts().get("geglu[fused gate-up, gate and up 4-bit (GELU none)]") == 2
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 5, mlp.Wi.in_features, requires_grad=True)
    with torch.no_grad():
        expected = type(ref.model.layers[0].mlp).forward(ref.model.layers[0].mlp, x)
    assert torch.equal(mlp(x), expected)
    for p in mlp.parameters():
        p.requires_grad_(False)  # frozen: the linears keep nothing, what is left is the product's
    run = memory.measure(mlp, x, backward=False)
    assert run.total == 2 * q_bytes(2 * 5 * mlp.Wo.in_features, 4)  # gate and up at 4 bits, nothing in full
    for p in mlp.parameters():
        p.requires_grad_(True)
    model.train(), ref.train()
    torch.manual_seed(0)
    model(**inputs).loss.backward()
    torch.manual_seed(0)
    ref(**inputs).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert (p.grad - q.grad).norm() <= 0.1 * q.grad.norm() + 1e-6, name


def test_fused_gated_mlp_with_dropout_is_checked_by_the_probe():
    """A dropout between the product and the down projection: the MLP keeps it (training mode draws a mask;
    eval mode is bit-identical), and its forward in eval equals the original's."""
    model, inputs = _modernbert_mlp(dropout=0.5)
    ref = copy.deepcopy(model).eval()
    slimfit.patch(model, SlimFitConfig.paper().replace(attention=None))
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, ref(**inputs).logits)
