"""The MLP's output projection found by structure, in every decoder of the zoo (not only in the families that
name it): its saved input gets `ffn_out_input_bits`, every other linear `linear_input_bits`."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import slimfit
from slimfit import SlimFitConfig
from slimfit.patching import handlers, structure

from .decoder_zoo import DECODERS, build_decoder
from .encoder_zoo import MODELS, build_model

# the last name of each decoder's MLP output projection (the MoE layers' experts take the bits themselves)
OUTPUT = {"phi": "fc2", "opt": "fc2", "gpt_neox": "dense_4h_to_h", "falcon": "dense_4h_to_h",
          "falcon-alibi": "dense_4h_to_h", "bloom": "dense_4h_to_h", "gptj": "fc_out", "starcoder2": "c_proj",
          "gpt2": "c_proj", "mixtral": None, "qwen3_moe": None}


@pytest.mark.parametrize("name", list(DECODERS))
def test_the_mlp_output_projection_and_only_it_keeps_its_input_at_ffn_out_bits(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = build_decoder(name)
        slimfit.patch(model, SlimFitConfig.paper())
    linears = {n: why for n, kind, why in model.slimfit_summary.patched if kind == "linear"}
    eight_bit = {n.rsplit(".", 1)[-1] for n, why in linears.items() if "input 8-bit" in why}
    expected = OUTPUT.get(name, "down_proj")
    assert eight_bit == ({expected} if expected else set())
    if expected:   # one per layer
        assert sum(n.endswith("." + expected) and "input 8-bit" in why for n, why in linears.items()) == \
            model.config.num_hidden_layers


# encoders: the MLP inside one module (ViT's mlp.fc2, T5's DenseReluDense.wo) or split over two siblings
# (BERT's intermediate.dense and output.dense: the latter, never attention.output.dense)
ENCODER_OUTPUT = {"albert": "ffn_output", "modernbert": "mlp.Wo", "vit": "mlp.fc2", "deit": "mlp.fc2",
                  "dinov2": "mlp.fc2", "beit": "mlp.fc2", "t5": "DenseReluDense.wo", "bart": "fc2"}


@pytest.mark.parametrize("name", list(MODELS))
def test_encoders_mlp_output_projection_by_structure(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = build_model(name)
        model = built[0] if isinstance(built, tuple) else built
        slimfit.patch(model, SlimFitConfig.paper())
    eight_bit = [n for n, kind, why in model.slimfit_summary.patched if kind == "linear" and "input 8-bit" in why]
    expected = ENCODER_OUTPUT.get(name, "output.dense")
    assert eight_bit and all(n.endswith("." + expected) and ".attention." not in n for n in eight_bit)


class _Adapter(nn.Module):
    """A bottleneck H -> r -> H: an activation between two linears, yet no MLP output projection."""

    def __init__(self, hidden=32, r=8):
        super().__init__()
        self.down, self.act, self.up = nn.Linear(hidden, r), nn.GELU(), nn.Linear(r, hidden)


class _MLP(nn.Module):
    def __init__(self, hidden=32, inner=128, act=None):
        super().__init__()
        self.fc_in, self.gelu_impl, self.fc_out = nn.Linear(hidden, inner), act or nn.GELU(), nn.Linear(inner, hidden)


class _Block(nn.Module):
    def __init__(self, hidden=32, mlp=None):
        super().__init__()
        self.config = type("Config", (), {"hidden_size": hidden})()
        self.mlp, self.adapter = mlp or _MLP(hidden), _Adapter(hidden)


def _found(model) -> set:
    ctx = handlers.PatchContext(SlimFitConfig.paper(), None)
    ids = structure.ffn_output_linears(model, handlers.activation_classes(ctx))
    return {name for name, module in model.named_modules() if id(module) in ids}


class _ParamFreeAct(nn.Module):
    def forward(self, x):
        return torch.tanh(x) * x


class _Intermediate(nn.Module):
    def __init__(self, hidden=32, inner=128):
        super().__init__()
        self.dense, self.act = nn.Linear(hidden, inner), nn.GELU()


class _Output(nn.Module):
    def __init__(self, hidden=32, inner=128):
        super().__init__()
        self.dense, self.norm = nn.Linear(inner, hidden), nn.LayerNorm(hidden)


class _SplitLayer(nn.Module):
    """BERT's layout: the MLP's two linears in sibling modules, beside an attention output H -> H."""

    def __init__(self, hidden=32):
        super().__init__()
        self.config = type("Config", (), {"hidden_size": hidden})()
        self.attention_output = nn.Linear(hidden, hidden)
        self.intermediate, self.output = _Intermediate(hidden), _Output(hidden)


def test_structure_finds_the_mlp_output_and_not_an_adapter():
    assert _found(_Block()) == {"mlp.fc_out"}
    assert _found(_SplitLayer()) == {"output.dense"}
    assert _found(_Block(mlp=_MLP(act=_ParamFreeAct()))) == {"mlp.fc_out"}   # an activation of no known class
    no_act = _MLP(act=nn.Dropout(0.1))
    assert _found(_Block(mlp=no_act)) == set()                                  # two linears, no activation
