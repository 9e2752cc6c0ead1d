"""slimfit.patch's chunked causal-LM loss: loss and every gradient as the model's own within fp32 rounding,
no B·S·vocab tensor saved, the original forward (bit-identical) without labels or without grad,
unpatch, and tiny Llama / GPT-2 training with it."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import slimfit  # noqa: E402
from slimfit import SlimFitConfig  # noqa: E402
from slimfit.patching.causal_lm import CAUSAL_LM_OPTIONS  # noqa: E402
from slimfit.scheduler import ILSScheduler  # noqa: E402

from .tiny_models import BATCH, SEQ, build  # noqa: E402

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gpt2"]
CHUNKED = SlimFitConfig(lm_head_chunk_rows=5)  # only the head changes (+ lossless frozen fast paths)


def _model(family, tied=False):
    if family == "qwen3":
        cfg = transformers.Qwen3Config(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                       max_position_embeddings=64, tie_word_embeddings=tied)
        torch.manual_seed(0)
        model = transformers.Qwen3ForCausalLM(cfg)
        _, inputs = build("llama")
    elif tied and family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                       tie_word_embeddings=True)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        _, inputs = build("llama")
    else:
        model, inputs = build(family)
    labels = inputs["labels"].clone()
    labels[0, :4] = -100  # a prompt whose tokens are not scored
    inputs["labels"] = labels
    return model, inputs


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_gradients_equal_the_models_own(family):
    model, inputs = _model(family)
    patched = slimfit.patch(copy.deepcopy(model), CHUNKED)
    summary = patched.slimfit_summary
    assert summary.counts()["causal-lm loss[chunked linear + cross-entropy, 5 rows per chunk (no logits kept; "
                            "logits=None in training)]"] == 1
    model.eval(), patched.eval()  # no dropout; gradients still flow
    ref, out = model(**inputs), patched(**inputs)
    assert out.logits is None and ref.logits is not None
    _close(out.loss, ref.loss)
    ref.loss.backward(), out.loss.backward()
    g_ref, g_out = _grads(model), _grads(patched)
    assert g_ref.keys() == g_out.keys()
    for name in g_ref:
        _close(g_out[name], g_ref[name])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tied_head_and_half_frozen_model(family):
    model, inputs = _model(family, tied=True)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    patched = slimfit.patch(copy.deepcopy(model), CHUNKED)
    for m in (model, patched):
        m.eval()
        for n, p in m.named_parameters():
            p.requires_grad_("layers.0." not in n)  # freeze layer 0; the tied embedding / head trains
    n_items = torch.tensor(31)
    ref, out = model(**inputs, num_items_in_batch=n_items), patched(**inputs, num_items_in_batch=n_items)
    _close(out.loss, ref.loss)
    ref.loss.backward(), out.loss.backward()
    g_ref, g_out = _grads(model), _grads(patched)
    assert "model.embed_tokens.weight" in g_out and g_ref.keys() == g_out.keys()
    for name in g_ref:
        _close(g_out[name], g_ref[name])
    # frozen tied head: the frozen path (input gradient formed in forward)
    model.zero_grad(), patched.zero_grad()
    model.model.embed_tokens.weight.requires_grad_(False), patched.model.embed_tokens.weight.requires_grad_(False)
    ref, out = model(**inputs), patched(**inputs)
    ref.loss.backward(), out.loss.backward()
    g_ref, g_out = _grads(model), _grads(patched)
    for name in g_ref:
        _close(g_out[name], g_ref[name])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_original_forward_without_labels_or_without_grad(family):
    model, inputs = _model(family)
    patched = slimfit.patch(copy.deepcopy(model), CHUNKED)
    model.eval(), patched.eval()
    no_labels = {k: v for k, v in inputs.items() if k != "labels"}
    assert torch.equal(patched(**no_labels).logits, model(**no_labels).logits)
    with torch.no_grad():
        out, ref = patched(**inputs), model(**inputs)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    out = patched(**inputs, logits_to_keep=SEQ)  # asks for logits: the model's own forward
    assert out.logits is not None and torch.equal(out.loss, model(**inputs, logits_to_keep=SEQ).loss)
    out = patched(**inputs, return_dict=False)  # a tuple, loss first (logits=None is left out, as HF does)
    assert isinstance(out, tuple) and out[0].dim() == 0


def _saved_numels(model, inputs):
    """numel of every saved tensor that is not a parameter (weights are not activations)."""
    numels = []
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            numels.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs).loss.backward()
    return numels


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_no_batch_by_seq_by_vocab_tensor_is_saved(family):
    small, inputs = _model(family)
    cfg = small.config
    cfg.vocab_size = 2000  # the logits the largest activation by far, as in real decoders
    model = type(small)(cfg)
    model.train()
    logits_numel = BATCH * SEQ * model.config.vocab_size
    assert max(_saved_numels(model, inputs)) >= logits_numel  # plain keeps the logits: the check can fail
    slimfit.patch(model, SlimFitConfig.paper())
    assert max(_saved_numels(model, inputs)) < logits_numel // 10
    run = slimfit.memory.measure(model, **inputs)
    plain = slimfit.memory.measure(slimfit.unpatch(model), **inputs)
    assert run.total < plain.total


def test_unpatch_restores_the_class_forward_and_state_dict():
    model, inputs = _model("llama")
    keys, cls = list(model.state_dict()), type(model)
    slimfit.patch(model, SlimFitConfig.paper())
    assert type(model) is not cls and isinstance(model, cls) and list(model.state_dict()) == keys
    assert "forward" not in vars(model)  # a class swap: a bound method on the instance is a reference cycle
    slimfit.unpatch(model)
    assert type(model) is cls and not hasattr(model, CAUSAL_LM_OPTIONS)
    assert model(**inputs).logits is not None
    # off in exact(): the model's own head
    summary = slimfit.patch(model, SlimFitConfig.exact()).slimfit_summary
    assert type(model) is cls and "causal-lm" not in str(summary)


def test_unknown_causal_lm_class_is_left_alone_and_said_so():
    class MyLlamaForCausalLM(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            return out

    model, _ = _model("llama")
    mine = MyLlamaForCausalLM(model.config)
    summary = slimfit.patch(mine, CHUNKED).slimfit_summary
    assert "forward" not in vars(mine)
    assert any(cls == "MyLlamaForCausalLM" and "keeps its own head and loss" in why for _, cls, why in summary.skipped)


def test_config_field_is_validated():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="lm_head_chunk_rows"):
            SlimFitConfig(lm_head_chunk_rows=bad)
    assert SlimFitConfig.paper().lm_head_chunk_rows and SlimFitConfig.aggressive().lm_head_chunk_rows
    assert SlimFitConfig.exact().lm_head_chunk_rows is None


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("preset", ["paper", "aggressive"])
def test_patched_tiny_model_trains_with_the_scheduler(family, preset):
    model, inputs = _model(family)
    slimfit.patch(model, SlimFitConfig.preset(preset))
    sched = ILSScheduler(model, freeze_rate=0.5, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched.attach_optimizer(opt)
    model.train()
    losses = []
    for _ in range(12):
        out = model(**inputs)
        assert out.logits is None
        out.loss.backward()
        opt.step(), opt.zero_grad(set_to_none=True), sched.step()
        losses.append(out.loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) < sum(losses[:3]) * 0.95, losses


def test_peft_lora_model_is_patched_inside():
    peft = pytest.importorskip("peft")
    model, inputs = _model("llama")
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    ref = peft.get_peft_model(copy.deepcopy(model), cfg)
    torch.manual_seed(0)
    lora = peft.get_peft_model(copy.deepcopy(model), cfg)
    lora.load_state_dict(ref.state_dict())
    slimfit.patch(lora, CHUNKED)
    ref.eval(), lora.eval()
    out, expected = lora(**inputs), ref(**inputs)
    assert out.logits is None and expected.logits is not None
    _close(out.loss, expected.loss)
    out.loss.backward(), expected.loss.backward()
    g_out, g_ref = _grads(lora), _grads(ref)
    assert g_ref and g_out.keys() == g_ref.keys()
    for name in g_ref:
        _close(g_out[name], g_ref[name])
