"""PyTorch's own attention (nn.MultiheadAttention in nn.TransformerEncoder, modules calling
F.scaled_dot_product_attention directly) through slimfit's paths (slimfit/patching/attention/torch_attention.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimfit
from slimfit.config import AttentionSaving, SlimFitConfig
from slimfit.memory import measure
from slimfit.patching.attention import torch_attention


class DirectSDPABlock(nn.Module):
    """A timm-style ViT block: fused qkv linear, F.scaled_dot_product_attention called directly."""

    def __init__(self, dim=64, heads=4, mlp=128):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.act, self.fc2 = nn.Linear(dim, mlp), nn.GELU(), nn.Linear(mlp, dim)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, c))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


def encoder(dropout=0.0):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=dropout, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def vit_blocks():
    torch.manual_seed(0)
    return nn.Sequential(DirectSDPABlock(), DirectSDPABlock())


class Count:
    def __init__(self, monkeypatch):
        self.calls = {"fused": 0, "materialize": 0}
        for name, attr in (("fused", "fused_attention"), ("materialize", "attention")):
            fn = getattr(torch_attention.autograd, attr)
            monkeypatch.setattr(torch_attention.autograd, attr, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def wrapped(*a, **kw):
            self.calls[name] += 1
            return fn(*a, **kw)
        return wrapped


def grads(model, x, **kw):
    model.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_()
    out = model(xx, **kw)
    out.pow(2).mean().backward()
    gs = [p.grad.clone() for p in model.parameters()] + [xx.grad.clone()]
    return out.detach(), gs


def cos(a, b):
    return float(F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


@pytest.mark.parametrize("build, kwargs", [
    (encoder, {}),
    (encoder, {"src_key_padding_mask": "pad"}),
    (encoder, {"is_causal": True}),
    (vit_blocks, {}),
])
def test_forward_exact_grads_close_and_fused(build, kwargs, monkeypatch):
    model = build()
    model.train()
    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(1))
    if kwargs.get("src_key_padding_mask") == "pad":
        pad = torch.zeros(2, 40, dtype=torch.bool)
        pad[1, 25:] = True
        kwargs = {"src_key_padding_mask": pad}
    if kwargs.get("is_causal"):
        kwargs = {"mask": nn.Transformer.generate_square_subsequent_mask(40), "is_causal": True}
    ref, g_ref = grads(model, x, **kwargs)
    plain = measure(lambda: model(x.clone().requires_grad_(), **kwargs).sum(), backward=False).total
    summary = slimfit.patch(model, SlimFitConfig.paper()).slimfit_summary
    assert any(name == "<sdpa>" for name, _, _ in summary.patched)
    count = Count(monkeypatch)
    out, g = grads(model, x, **kwargs)
    assert count.calls == {"fused": 2, "materialize": 0}
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)  # 4-bit GELU etc. change no forward value
    flat = torch.cat([t.flatten() for t in g])
    flat_ref = torch.cat([t.flatten() for t in g_ref])
    assert cos(flat, flat_ref) > 0.99
    patched = measure(lambda: model(x.clone().requires_grad_(), **kwargs).sum(), backward=False).total
    assert patched < plain
    before = dict(count.calls)
    slimfit.unpatch(model)
    assert not hasattr(model, torch_attention.ROUTER)
    out2, g2 = grads(model, x, **kwargs)
    assert count.calls == before  # unpatched: no routing
    assert torch.equal(out2, ref)


def test_attention_core_bytes_are_the_fused_formula():
    """Only the attention op: Q/K/V at 8 bits, nothing of size S×S."""
    from slimfit.autograd.fused_attention import quantized_bytes

    model = vit_blocks()[:1]
    cfg = SlimFitConfig(attention=AttentionSaving(qkv_bits=8, probs="int8"))
    slimfit.patch(model, cfg)
    q = torch.randn(2, 4, 40, 16, requires_grad=True)
    from slimfit.memory import saved_bytes

    with torch_attention._SDPARouter({"qkv_bits": 8, "probs": "int8", "keep_ratio": 0.1, "group_size": 128,
                                      "dropout_on_v": False, "path": "auto"}):
        got = saved_bytes(lambda: F.scaled_dot_product_attention(q, q, q))
    assert got == 3 * quantized_bytes(q.numel(), 8, 128)


def test_dropout_on_cpu_takes_the_materializing_path_and_replays(monkeypatch):
    model = encoder(dropout=0.1)
    slimfit.patch(model, SlimFitConfig.paper())
    count = Count(monkeypatch)
    model.train()
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    _, g1 = grads(model, x)
    torch.manual_seed(5)
    _, g2 = grads(model, x)
    assert count.calls == {"fused": 0, "materialize": 4}
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_no_grad_and_need_weights_left_alone(monkeypatch):
    model = encoder()
    slimfit.patch(model, SlimFitConfig.paper())
    count = Count(monkeypatch)
    x = torch.randn(2, 16, 64)
    with torch.no_grad():
        model(x)
    mha = nn.MultiheadAttention(64, 4, batch_first=True)
    slimfit.patch(mha, SlimFitConfig.paper())
    y = torch.randn(2, 16, 64, requires_grad=True)
    out, weights = mha(y, y, y)  # need_weights=True: softmax computed by MHA itself, no SDPA call
    assert weights is not None
    assert count.calls == {"fused": 0, "materialize": 0}
    mha(y, y, y, need_weights=False)[0].sum().backward()
    assert count.calls == {"fused": 1, "materialize": 0}


def test_router_leaves_no_mode_behind_after_an_error():
    model = vit_blocks()
    slimfit.patch(model, SlimFitConfig.paper())
    with pytest.raises((RuntimeError, ValueError)):
        model(torch.randn(2, 10, 32, requires_grad=True))  # wrong width
    # the mode was left: a plain SDPA call outside the model is not routed
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    out = F.scaled_dot_product_attention(q, q, q)
    assert out.grad_fn is not None and "Fused" not in type(out.grad_fn).__name__
    assert model[0].__class__ is not None and torch_attention.ROUTER in vars(model)
    assert getattr(model, torch_attention.ROUTER).depth == 0
