"""The handler table and the family registry: a toy family and a toy handler, registered at run time,
patch a toy model through the same walk as the built-in ones (docs/architecture.md "Add a model family")."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import slimfit
from slimfit import SlimFitConfig
from slimfit.patching import families, handlers
from slimfit.patching.modules import OPTIONS, ORIGINAL_CLASS
from slimfit.patching.options import ActivationOptions, LinearOptions, NormOptions


class ToyRMSNorm(nn.Module):  # LlamaRMSNorm's formula
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class ToyMLP(nn.Module):  # down_proj(act_fn(gate_proj(x)) * up_proj(x))
    def __init__(self, d, h):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(h, d)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ToyBlock(nn.Module):
    def __init__(self, d=32, h=64):
        super().__init__()
        self.norm, self.mlp = ToyRMSNorm(d), ToyMLP(d, h)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class ToyModel(nn.Module):
    def __init__(self, model_type="toy"):
        super().__init__()
        self.config = SimpleNamespace(model_type=model_type)
        self.layers = nn.ModuleList([ToyBlock(), ToyBlock()])
        self.scale = Scale()

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.scale(x)


class Scale(nn.Module):
    def forward(self, x):
        return 2 * x


class HalfScaleMixin:
    def forward(self, x):
        return getattr(self, OPTIONS).factor * x


@dataclasses.dataclass(frozen=True)
class ScaleOptions:
    factor: float


TOY = families.Family(
    name="toy", model_types=("toy",), ffn_out_suffixes=(".mlp.down_proj",),
    sampled_suffixes=(".mlp.down_proj",), swiglu_mlps=("ToyMLP",), rmsnorms=("ToyRMSNorm",),
    notes=("a family registered by a test",),
)


@pytest.fixture
def toy_family():
    families.register(TOY)
    try:
        yield TOY
    finally:
        families.unregister(TOY)


class ToyScaledRMSNorm(ToyRMSNorm):  # RMSNorm-shaped, another formula
    def forward(self, x):
        return 2 * super().forward(x)


def test_unregistered_toy_model_is_recognised_by_structure():
    model = ToyModel()
    summary = slimfit.patch(model, SlimFitConfig.paper()).slimfit_summary
    assert summary.family == "generic" and summary.notes == ()
    kinds = [kind for _, kind, _ in summary.patched]
    assert kinds.count("swiglu") == 2 and kinds.count("rmsnorm") == 2  # no family lists them: structure + probe
    assert [name for name, _, _ in summary.skipped] == ["<attention>"]


def test_a_norm_shaped_module_of_another_formula_is_left_alone_with_the_reason():
    model = ToyModel()
    model.layers[0].norm = ToyScaledRMSNorm(32)
    summary = slimfit.patch(model, SlimFitConfig.paper()).slimfit_summary
    assert ("layers.0.norm", "ToyScaledRMSNorm", handlers._RMSNORM_UNKNOWN) in summary.skipped
    assert type(model.layers[0].norm) is ToyScaledRMSNorm and not hasattr(model.layers[0].norm, ORIGINAL_CLASS)


def test_a_registered_family_patches_its_modules(toy_family):
    torch.manual_seed(0)
    model = ToyModel()
    reference = ToyModel()
    reference.load_state_dict(model.state_dict())
    summary = slimfit.patch(model, SlimFitConfig.paper()).slimfit_summary
    assert summary.family == "toy" and summary.notes == TOY.notes
    patched = {name: (kind, mode) for name, kind, mode in summary.patched}
    assert patched["layers.0.mlp"] == ("swiglu", "gate and up 4-bit")
    assert patched["layers.0.norm"] == ("rmsnorm", "int8/int8 when frozen")
    assert patched["layers.0.mlp.down_proj"] == ("linear", "input 8-bit, frozen fast path")  # ffn_out_input_bits
    assert patched["layers.0.mlp.up_proj"] == ("linear", "input full, frozen fast path")
    assert "layers.0.mlp.act_fn" not in patched  # computed by the SwiGLU MLP itself
    assert isinstance(getattr(model.layers[0].mlp, OPTIONS), ActivationOptions)
    assert isinstance(getattr(model.layers[0].norm, OPTIONS), NormOptions)
    options = getattr(model.layers[0].mlp.down_proj, OPTIONS)
    assert isinstance(options, LinearOptions) and options.input_bits == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.input_bits = 4

    x = torch.randn(3, 5, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    model(x).sum().backward()
    reference(x_ref).sum().backward()
    # 4-bit gate/up and 8-bit down_proj input: close to the exact gradient, not equal
    assert (x.grad - x_ref.grad).norm() / x_ref.grad.norm() < 0.1

    slimfit.unpatch(model)
    assert type(model.layers[0].mlp) is ToyMLP and type(model.layers[0].norm) is ToyRMSNorm
    assert not any(ORIGINAL_CLASS in vars(m) for m in model.modules())


def test_a_registered_family_samples_its_targets(toy_family):
    model = ToyModel()
    summary = slimfit.patch(model, SlimFitConfig.paper().with_sampling(method="wta_crs")).slimfit_summary
    sampled = sorted(name for name, kind, mode in summary.patched if kind == "linear" and "of rows" in mode)
    assert sampled == ["layers.0.mlp.down_proj", "layers.1.mlp.down_proj"]
    assert getattr(model.layers[0].mlp.down_proj, OPTIONS).sampling.name == "layers.0.mlp.down_proj"


def test_a_registered_handler_takes_its_modules():
    handler = handlers.Handler(
        "scale", lambda m, ctx: type(m) is Scale, HalfScaleMixin,
        options=lambda ctx, name, m: ScaleOptions(factor=0.5),
        describe=lambda ctx, o: f"factor {o.factor}",
    )
    handlers.register(handler, before="linear")
    try:
        assert handlers.HANDLERS[0] is handler
        model = ToyModel()
        summary = slimfit.patch(model, SlimFitConfig.paper()).slimfit_summary
        assert ("scale", "scale", "factor 0.5") in summary.patched
        x = torch.ones(2, 32)
        assert torch.equal(model.scale(x), 0.5 * x)
        slimfit.unpatch(model)
        assert type(model.scale) is Scale and torch.equal(model.scale(x), 2 * x)
    finally:
        handlers.unregister(handler)
    assert handler not in handlers.HANDLERS


def test_a_handler_skip_reason_goes_to_the_summary():
    handler = handlers.Handler("scale", lambda m, ctx: type(m) is Scale, skip=lambda ctx, m: "scales stay")
    handlers.register(handler)
    try:
        summary = slimfit.patch(ToyModel(), SlimFitConfig.paper()).slimfit_summary
        assert ("scale", "Scale", "scales stay") in summary.skipped
    finally:
        handlers.unregister(handler)


def test_register_checks_its_argument():
    with pytest.raises(TypeError, match="Family"):
        families.register({"name": "toy"})
