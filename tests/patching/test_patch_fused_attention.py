"""Hugging Face models through slimfit's attention routing: the fused path by default
(slimfit.patching.attention.hf_attention.choose_path), the materializing path where no fused kernel exists."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import slimfit
from slimfit.config import SlimFitConfig
from slimfit.patching.attention import hf_attention


class LargeAllocations(TorchDispatchMode):
    """Records every op output whose storage holds at least `limit` elements
    (as in tests/autograd/test_fused_attention.py)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.seen: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= self.limit * t.element_size():
                self.seen.append((str(func), tuple(t.shape)))
        return out


def tiny_decoder(family="llama", seq=32, batch=2, vocab=128, pad=True, **extra):
    import transformers as tf

    torch.manual_seed(0)
    cfg_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                          "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[family]
    cfg = cfg_cls(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=max(64, seq),
                  attn_implementation="sdpa", **extra)
    model = model_cls(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if pad:
        mask[0, : seq // 4] = 0  # left padding in one row: a real mask reaches attention
    labels = ids.masked_fill(mask == 0, -100)
    return model, {"input_ids": ids, "attention_mask": mask, "labels": labels}


def grads_of(model, inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def cos(a, b):
    return float(F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


class CountPaths:
    """Counts the calls of each attention path while active."""

    def __init__(self, monkeypatch):
        self.calls = {"fused": 0, "materialize": 0}
        fused, mat = hf_attention.autograd.fused_attention, hf_attention.autograd.attention

        def count(name, fn):
            def wrapped(*a, **kw):
                self.calls[name] += 1
                return fn(*a, **kw)
            return wrapped

        monkeypatch.setattr(hf_attention.autograd, "fused_attention", count("fused", fused))
        monkeypatch.setattr(hf_attention.autograd, "attention", count("materialize", mat))


@pytest.mark.parametrize("pad", [False, True])
def test_tiny_llama_paper_loss_exact_and_gradients_close(pad, monkeypatch):
    model, inputs = tiny_decoder(pad=pad)
    model.train()
    loss_ref, g_ref = grads_of(model, inputs)
    slimfit.patch(model, SlimFitConfig.paper())
    paths = CountPaths(monkeypatch)
    loss, g = grads_of(model, inputs)
    assert paths.calls == {"fused": 2, "materialize": 0}
    assert torch.allclose(loss, loss_ref, rtol=1e-6, atol=0)  # forward exact up to fp32 rounding
    assert g.keys() == g_ref.keys()
    flat = torch.cat([g[n].flatten() for n in g_ref])
    flat_ref = torch.cat([g_ref[n].flatten() for n in g_ref])
    assert cos(flat, flat_ref) > 0.99
    attn = [n for n in g_ref if ".self_attn." in n]
    assert min(cos(g[n], g_ref[n]) for n in attn) > 0.99


def test_sliding_window_mask_takes_the_fused_path(monkeypatch):
    model, inputs = tiny_decoder("mistral", seq=40, pad=False, sliding_window=8)
    loss_ref, g_ref = grads_of(model, inputs)
    slimfit.patch(model, SlimFitConfig.paper().with_attention(qkv_bits=None).replace(
        silu_bits=None, ffn_out_input_bits=None, layernorm="full", layernorm_frozen="full"))
    paths = CountPaths(monkeypatch)
    loss, g = grads_of(model, inputs)
    assert paths.calls["fused"] == 2 and paths.calls["materialize"] == 0
    assert torch.allclose(loss, loss_ref, rtol=1e-6, atol=0)
    for n in g_ref:  # nothing compressed in attention: the sliding-window gradients are SDPA's
        assert torch.allclose(g[n], g_ref[n], rtol=1e-4, atol=1e-6), n


def test_materialize_option_and_dropout_fallback(monkeypatch):
    model, inputs = tiny_decoder(attention_dropout=0.1)
    slimfit.patch(model, SlimFitConfig.paper().with_attention(path="fused"))
    paths = CountPaths(monkeypatch)
    hf_attention._warned_fallback.clear()
    model.train()
    with pytest.warns(UserWarning, match="no fused PyTorch kernel"):
        torch.manual_seed(3)
        _, g1 = grads_of(model, inputs)
    assert paths.calls == {"fused": 0, "materialize": 2}  # the CPU fused op refuses dropout
    torch.manual_seed(3)
    _, g2 = grads_of(model, inputs)  # dropout replayed from the seed: same gradients
    assert all(torch.equal(g1[n], g2[n]) for n in g1)
    assert paths.calls == {"fused": 0, "materialize": 4}
    model.eval()  # no dropout in eval: fused
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads_of(model, inputs)
    assert paths.calls["fused"] == 2
    slimfit.unpatch(model)
    slimfit.patch(model, SlimFitConfig.paper().with_attention(path="materialize"))
    grads_of(model, inputs)
    assert paths.calls == {"fused": 2, "materialize": 6}


def test_auto_rule_by_bytes():
    """'auto' compares the byte formulas of both paths (docs/attention.md)."""
    q = torch.randn(1, 4, 16, 64)
    k = v = torch.randn(1, 2, 16, 64)
    opts = {"qkv_bits": 8, "probs": "int8", "keep_ratio": 0.1, "group_size": 128, "dropout_on_v": False,
            "path": "auto"}
    assert hf_attention.choose_path(opts, q, k, v, None, 0.0, True)[0] == "fused"
    fused = hf_attention._saved_bytes("fused", opts, q, k, v)
    mat = hf_attention._saved_bytes("materialize", opts, q, k, v)
    assert fused < mat  # the fused path keeps Q/K/V only; the other adds P and expanded K/V
    assert hf_attention.choose_path(opts, q, k, v, None, 0.1, False)[0] == "materialize"  # CPU dropout
    assert hf_attention.choose_path({**opts, "path": "materialize"}, q, k, v, None, 0.0, True)[0] == "materialize"


def test_config_validates_attention_path():
    with pytest.raises(ValueError, match="AttentionSaving.path"):
        SlimFitConfig.paper().with_attention(path="flash")
    assert SlimFitConfig.paper().attention.path == "auto"


@pytest.mark.parametrize("path, expect_large", [("auto", False), ("materialize", True)])
def test_model_training_step_at_seq_1024_allocates_nothing_s_by_s(path, expect_large):
    s = 1024
    model, inputs = tiny_decoder(seq=s, batch=1, vocab=128, pad=False)
    slimfit.patch(model, SlimFitConfig.paper().with_attention(path=path))
    model.train()
    with LargeAllocations(s * s) as rec:
        model(**inputs).loss.backward()
    assert bool(rec.seen) == expect_large, rec.seen[:5]
