"""DeBERTa's disentangled attention through slimfit: the forward equals the model's own bit for bit, the
gradients (Q/K/V kept exact) match PyTorch's autograd of the model's own forward, padding rows included,
the dropout's gradient is the exact one with the regenerated mask, and nothing of size S×S is saved."""
from __future__ import annotations

import pytest
import torch

import slimfit
from slimfit import SlimFitConfig
from slimfit.autograd import disentangled_attention as da
from slimfit.kernels.reference import apply_keep

H, D, S, B = 2, 8, 7, 2


def _config(**extra):
    import transformers as tf

    base = dict(vocab_size=64, hidden_size=H * D, num_hidden_layers=1, num_attention_heads=H, intermediate_size=32,
                max_position_embeddings=32, relative_attention=True, position_buckets=4, max_relative_positions=16,
                pos_att_type=["p2c", "c2p"], attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    return tf.DebertaV2Config(**{**base, **extra})


def _model(**extra):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.DebertaV2Model(_config(**extra)).train()
    with torch.no_grad():   # weights large enough that every attention term moves the loss (init: std 0.02)
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embeddings" not in name:
                p.normal_(0.0, 0.3)
    return model


def _inputs():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (B, S), generator=generator)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -3:] = 0                     # padded keys, and query rows masked whole
    return {"input_ids": ids, "attention_mask": mask}


def _loss(model, inputs):
    """Every position's output weighs in (a classifier's loss would read the first token only)."""
    out = model(**inputs).last_hidden_state
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    return out, (out * weights).sum()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("extra", [{}, {"share_att_key": True}, {"pos_att_type": ["c2p"]},
                                   {"relative_attention": False}], ids=["p2c+c2p", "shared", "c2p", "no-rel"])
def test_forward_bit_identical_and_gradients_match_pytorch(extra):
    model = _model(**extra)
    inputs = _inputs()
    out, loss = _loss(model, inputs)
    loss.backward()
    plain_out, plain = out.detach(), _grads(model)
    model.zero_grad(set_to_none=True)
    slimfit.patch(model, SlimFitConfig.exact().with_attention(qkv_bits=None))
    out, loss = _loss(model, inputs)
    loss.backward()
    summary = model.slimfit_summary.attention_calls()
    assert summary["reached"] == summary["forwards"] == 1 and not summary["not_reached"]
    assert torch.equal(out.detach(), plain_out)
    patched = _grads(model)
    assert patched.keys() == plain.keys()
    largest = max(grad.abs().max().item() for grad in plain.values())
    for name, grad in plain.items():   # a gradient that is 0 in exact math (a key bias without position
        scale = grad.abs().max().item()  # terms) is rounding noise in both: the floor is the largest one's
        torch.testing.assert_close(patched[name], grad, rtol=1e-4, atol=1e-5 * scale + 1e-7 * largest, msg=name)
        if "attention.self" in name and name.endswith("weight"):
            assert scale > 1e-3, name       # the attention's own weights do move the loss


def _call(q, k, v, pos_key, pos_query, rel, mask, p, bits=None):
    from slimfit.patching.options import AttentionOptions

    options = AttentionOptions.from_config(SlimFitConfig.exact().with_attention(qkv_bits=bits))
    return da.disentangled_attention(q, k, v, pos_key, pos_query, rel, mask, 4, torch.tensor(4.0), H, p, options)


def _tensors():
    generator = torch.Generator().manual_seed(2)

    def leaf(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_(True)

    ids = torch.arange(S)
    rel = (ids[:, None] - ids[None, :]).view(1, 1, S, S)
    mask = torch.ones(B, 1, S, S, dtype=torch.long)
    mask[0, :, :, -2:] = 0
    mask[1, :, -1, :] = 0                # a query row masked whole: uniform P, no gradient
    return leaf(B * H, S, D), leaf(B * H, S, D), leaf(B * H, S, D), leaf(H, 8, D), leaf(H, 8, D), rel, mask


def test_dropout_gradient_is_the_exact_one_with_the_regenerated_mask(monkeypatch):
    monkeypatch.setattr(da, "draw_seed", lambda: 1234)
    q, k, v, pk, pq, rel, mask = _tensors()
    _call(q, k, v, pk, pq, rel, mask, 0.3).square().sum().backward()
    got = [t.grad.clone() for t in (q, k, v, pk, pq)]
    for t in (q, k, v, pk, pq):
        t.grad = None
    probs = da._probs(da._scores(q, k, pk, pq, rel, 4, torch.tensor(4.0), B), mask, H).view(B * H, S, S)
    keep = da.keep_mask(probs, 0.3, 1234)
    torch.bmm(apply_keep(probs, keep, 0.3), v).square().sum().backward()
    for name, a, b in zip("q k v pos_key pos_query".split(), got, (q, k, v, pk, pq)):
        torch.testing.assert_close(a, b.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_nothing_of_size_s_by_s_is_saved():
    q, k, v, pk, pq, rel, mask = _tensors()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _call(q, k, v, pk, pq, rel, mask, 0.1, bits=8)
    own = [t for t in saved if t is not rel and t is not mask]   # the model's tensors, shared by every layer
    assert own and not any(t.numel() % (S * S) == 0 and t.numel() >= B * H * S * S for t in own)
    codes = B * H * S * D + 8 * -(-B * H * S * D // 128)           # 8-bit codes + fp32 scale, offset per group
    assert sum(t.numel() * t.element_size() for t in own) == 3 * codes + 2 * 4 * H * 8 * D
    out.sum().backward()
    assert q.grad is not None and pk.grad is not None and pk.grad.shape == pk.shape


def test_a_call_the_core_does_not_cover_runs_the_models_forward_and_is_counted():
    model = _model()
    inputs = _inputs()
    with torch.no_grad():
        plain = model(**inputs, output_attentions=True)
    slimfit.patch(model, SlimFitConfig.paper())
    out = model(**inputs, output_attentions=True)          # the probabilities are asked for: the model's own
    torch.testing.assert_close(out.attentions[0], plain.attentions[0], rtol=0, atol=0)
    calls = model.slimfit_summary.attention_calls()
    assert calls["forwards"] == 1 and calls["reached"] == 0
    assert [why for _, why in calls["not_reached"]] == ["output_attentions=True (the probabilities are returned)"]
