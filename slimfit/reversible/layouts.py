"""How MEFT reads each supported layer layout (`BlockLayout`): its attention block and its MLP block, built from
the layer's own submodules (no modeling code copied), with optional adapters.

Post-LN (BERT, RoBERTa, ELECTRA, ... `BertLayer` layout):
    attn(x; φ)  = LN_att(x + o + φ(o)),          o = dropout(W_o · SelfAttention(x))
    mlp(u; ψ)   = LN_out(u + dropout(W_2 act(W_1 u)) + ψ(u))
Pre-LN (GPT-2 `GPT2Block`):
    attn(x; φ)  = x + o + φ(o),                   o = resid_dropout(c_proj · Attention(ln_1 x))
    mlp(u; ψ)   = u + MLP(ln_2 u) + ψ(ln_2 u)
Without adapters (φ = ψ = 0) `mlp(attn(x))` is the pretrained layer, op for op. "The layer" in
MEFT's F or G is always this whole function, residual connections and LayerNorms included.
"""
from __future__ import annotations

import copy
import inspect

import torch
from torch import nn


class UnsupportedModel(TypeError):
    pass


def _activation(name_or_fn) -> nn.Module:
    if isinstance(name_or_fn, nn.Module):
        return copy.deepcopy(name_or_fn)
    from transformers.activations import ACT2FN

    if isinstance(name_or_fn, str):
        return ACT2FN[name_or_fn]
    raise UnsupportedModel(f"slimfit.reversible: cannot build an adapter activation from {name_or_fn!r}")


class BlockLayout:
    name = ""
    layer_hint = ""
    prenorm = False
    # names of the layer forward's arguments that MEFT cannot pass through (cross-attention)
    cross_args = ("encoder_hidden_states",)

    def matches(self, layer: nn.Module) -> bool:
        raise NotImplementedError

    def check(self, layer: nn.Module) -> None:
        """Raise UnsupportedModel for a matching layer in a configuration MEFT does not handle."""

    def hidden_size(self, layer: nn.Module) -> int:
        raise NotImplementedError

    # the layer's model config, the config key naming its activation, its FFN activation module and
    # a hidden dropout module: the adapter uses the same activation and dropout probability
    act_key = ""

    def parts(self, layer: nn.Module) -> tuple:
        """(config or None, activation module, dropout module)"""
        raise NotImplementedError

    def adapter_activation(self, layer: nn.Module) -> nn.Module:
        cfg, act, _ = self.parts(layer)
        name = getattr(cfg, self.act_key, None) if cfg is not None else None
        return _activation(name if isinstance(name, str) else act)

    def adapter_dropout(self, layer: nn.Module) -> float:
        return float(self.parts(layer)[2].p)

    def attn(self, layer, x, attn_kwargs: dict, adapter=None) -> torch.Tensor:
        raise NotImplementedError

    def mlp(self, layer, u, adapter=None) -> torch.Tensor:
        raise NotImplementedError

    def bind(self, original_forward, layer, hidden_states, args, kwargs) -> dict:
        """The layer call's arguments -> keyword arguments for the attention module."""
        sig = inspect.signature(original_forward)
        bound = sig.bind(layer, hidden_states, *args, **kwargs)
        bound.apply_defaults()
        params = list(sig.parameters.values())
        named = dict(bound.arguments)
        for p in params[:2]:  # self, hidden_states
            named.pop(p.name, None)
        extra = {}
        for p in params:
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                extra = named.pop(p.name, None) or {}
            elif p.kind is inspect.Parameter.VAR_POSITIONAL and named.pop(p.name, ()):
                raise TypeError(f"slimfit.reversible: unexpected positional arguments for {type(layer).__name__}")
        for name in self.cross_args:
            if named.pop(name, None) is not None or extra.pop(name, None) is not None:
                raise NotImplementedError(
                    f"slimfit.reversible: {type(layer).__name__} was called with {name} (cross-attention); "
                    "MEFT conversion supports self-attention layers only")
        named.pop("encoder_attention_mask", None)
        named.update(extra)
        named.pop("output_attentions", None)
        return named


class BertLayout(BlockLayout):
    name = "bert"
    layer_hint = "BERT-family encoder layers (BertLayer layout: BERT, RoBERTa, XLM-R, ELECTRA, MiniLM, ...)"

    def matches(self, layer):
        att = getattr(layer, "attention", None)
        out = getattr(layer, "output", None)
        return (att is not None and hasattr(att, "self") and hasattr(att, "output")
                and all(hasattr(att.output, n) for n in ("dense", "dropout", "LayerNorm"))
                and hasattr(layer, "intermediate") and out is not None
                and all(hasattr(out, n) for n in ("dense", "dropout", "LayerNorm")))

    def check(self, layer):
        if getattr(layer, "add_cross_attention", False) or hasattr(layer, "crossattention"):
            raise UnsupportedModel(
                f"slimfit.reversible: {type(layer).__name__} has cross-attention; MEFT conversion supports "
                "self-attention encoders/decoders only")

    def hidden_size(self, layer):
        return layer.output.dense.out_features

    act_key = "hidden_act"

    def parts(self, layer):
        config = getattr(layer.attention.self, "config", None)
        return config, layer.intermediate.intermediate_act_fn, layer.output.dropout

    def attn(self, layer, x, attn_kwargs, adapter=None):
        a, _ = layer.attention.self(x, **attn_kwargs)
        out = layer.attention.output
        h = out.dropout(out.dense(a))
        if adapter is not None:
            h = h + adapter(h)
        return out.LayerNorm(h + x)

    def mlp(self, layer, u, adapter=None):
        out = layer.output
        h = out.dropout(out.dense(layer.intermediate(u)))
        if adapter is not None:
            h = h + adapter(u)
        return out.LayerNorm(h + u)


class GPT2Layout(BlockLayout):
    name = "gpt2"
    prenorm = True
    layer_hint = "GPT-2 decoder blocks (GPT2Block)"

    def matches(self, layer):
        return all(hasattr(layer, n) for n in ("ln_1", "attn", "ln_2", "mlp")) and hasattr(layer.attn, "c_attn")

    def check(self, layer):
        if hasattr(layer, "crossattention"):
            raise UnsupportedModel(
                f"slimfit.reversible: {type(layer).__name__} has cross-attention (add_cross_attention=True); "
                "MEFT conversion supports self-attention decoders only")

    def hidden_size(self, layer):
        return layer.ln_1.normalized_shape[0]

    act_key = "activation_function"

    def parts(self, layer):
        return getattr(layer.attn, "config", None), layer.mlp.act, layer.mlp.dropout

    def attn(self, layer, x, attn_kwargs, adapter=None):
        a, _ = layer.attn(layer.ln_1(x), **attn_kwargs)
        if adapter is not None:
            a = a + adapter(a)
        return a + x

    def mlp(self, layer, u, adapter=None):
        z = layer.ln_2(u)
        m = layer.mlp(z)
        if adapter is not None:
            m = m + adapter(z)
        return u + m


LAYOUTS = (BertLayout(), GPT2Layout())
SUPPORTED = "; ".join(f.layer_hint for f in LAYOUTS)


def layout_of_layer(layer: nn.Module) -> BlockLayout | None:
    for layout in LAYOUTS:
        if layout.matches(layer):
            return layout
    return None
