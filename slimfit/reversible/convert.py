"""convert / unconvert / add_adapters / set_reversible_layers: MEFT in place on a Hugging Face model.

Each transformer layer keeps its parameters and state_dict keys; its class is swapped for a
subclass (`SlimFit<Layer>`, built by slimfit.patch's `patched_class`) whose forward implements the
MEFT layer, and adapters are added as new submodules (`meft_ffn_adapter`, `meft_attn_adapter`,
`meft_rev_adapter`). The model's own loop still calls the layers one by one, so the call signature
and outputs of the model are unchanged:

    layer 0           duplicates its input h -> (x1, x2) = (h, h); when a backward will be needed it
                      runs the whole reversible group (layers 0 .. n_rev-1) in one autograd Function
    layers 1..n_rev-1 pass the pair through (already computed by layer 0's Function)
    layers >= n_rev   one MEFT layer each with plain autograd
    last layer        returns (x1 + x2) / 2, width d again

Between layers the hidden state is the pair concatenated on the last dimension (width 2·d).
"""
from __future__ import annotations

import dataclasses
import weakref

import torch
from torch import nn

from ..patching.modules import patched_class
from .adapter import Adapter
from .function import ReversibleStack, coupling, layer_seeds, split_tensors, swap_pair
from .layouts import SUPPORTED, UnsupportedModel, layout_of_layer

STATE = "_slimfit_meft"          # per layer: {"plan", "index", "original_class"}
MODEL_STATE = "_slimfit_meft_model"
ADAPTER_NAMES = ("meft_ffn_adapter", "meft_attn_adapter", "meft_rev_adapter")
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")  # by transformers version


@dataclasses.dataclass(frozen=True)
class Form:
    name: str
    lam: float          # scale of x1 in y1 = λ·x1 + F(x2)
    beta: float         # scale of x2 in y2 = β·x2 + G(y1)
    swap: bool          # next layer's input is (y2, y1)
    f: str              # "layer" | "adapter" | "attn"
    g: str              # "adapter" | "layer" | "mlp"
    adapters: tuple     # which adapter slots a layer gets
    last: int = 1       # which half of the final pair carries the last pretrained block's output


FORMS = {
    "meft1": Form("meft1", 0.1, 1.0, True, "layer", "adapter", ("meft_ffn_adapter", "meft_rev_adapter"), 1),
    "meft2": Form("meft2", 1.0, 0.1, True, "adapter", "layer", ("meft_ffn_adapter", "meft_rev_adapter"), 0),
    "meft3": Form("meft3", 0.1, 0.1, False, "attn", "mlp", ("meft_attn_adapter", "meft_ffn_adapter"), 1),
}
ADAPTERS_ONLY = Form("adapters", 1.0, 1.0, False, "layer", "", ("meft_ffn_adapter",))


@dataclasses.dataclass
class MeftSummary:
    model_class: str
    family: str
    form: str
    lam: float
    beta: float
    swap: bool
    layers: int
    reversible_layers: int
    bottleneck: int
    layer_path: str
    output: str = "mean"
    stream_dtype: str = "model dtype"
    adapters: list = dataclasses.field(default_factory=list)   # module paths of the added adapters
    trainable: list = dataclasses.field(default_factory=list)  # names of parameters that train
    trainable_params: int = 0
    total_params: int = 0

    def __str__(self) -> str:
        kind = ("plain adapters (parallel to each FFN), no reversibility" if self.form == "adapters" else
                f"{self.form}: λ={self.lam:g}, β={self.beta:g}, {'swapped' if self.swap else 'not swapped'}; "
                f"reversible layers {self.reversible_layers}/{self.layers}; output {self.output}; "
                f"stream {self.stream_dtype}")
        pct = 100.0 * self.trainable_params / max(self.total_params, 1)
        return (f"slimfit.reversible: {self.model_class} ({self.family} layers at {self.layer_path}) -> {kind}\n"
                f"  adapters: {len(self.adapters)} of bottleneck {self.bottleneck}; trainable parameters "
                f"{self.trainable_params:,} of {self.total_params:,} ({pct:.2f}%)")


class _Recorder:
    def __init__(self):
        self.forward: dict[int, tuple] = {}
        self.backward: dict[int, tuple] = {}


class Plan:
    """Everything the converted layers share (a plain object, not a module: no state_dict entries)."""

    def __init__(self, family, form, layers, n_rev, hidden_size, stream_dtype=None, output="mean"):
        self.family, self.form, self.layers = family, form, list(layers)
        self.n_rev, self.hidden_size = n_rev, hidden_size
        self.stream_dtype, self.output = stream_dtype, output
        self._compute_dtype = None  # dtype of the hidden state entering layer 0 in the current forward
        self.recorder: _Recorder | None = None
        self._fused = None  # weak reference to the pair layer 0's reversible Function returned

    # blocks -------------------------------------------------------------------------------------
    def block(self, layer, which, x, attn_kwargs):
        fam = self.family
        if which == "layer":
            return fam.mlp(layer, fam.attn(layer, x, attn_kwargs), layer.meft_ffn_adapter)
        if which == "adapter":
            return layer.meft_rev_adapter(x)
        if which == "attn":
            return fam.attn(layer, x, attn_kwargs, layer.meft_attn_adapter)
        if which == "mlp":
            return fam.mlp(layer, x, layer.meft_ffn_adapter)
        raise ValueError(which)

    @staticmethod
    def trainable(layer) -> list:
        return [p for p in layer.parameters() if p.requires_grad]

    def record(self, kind, i, x1, x2):
        if self.recorder is not None:
            getattr(self.recorder, kind)[i] = (x1.detach().clone(), x2.detach().clone())

    # layer forward ------------------------------------------------------------------------------
    def _plain(self, layer, i, x1, x2, attn_kwargs):
        self.record("forward", i, x1, x2)
        y1, y2 = coupling(self, layer, x1, x2, attn_kwargs, layer_seeds(layer), self._compute_dtype)
        return torch.cat(swap_pair(self.form, y1, y2), dim=-1)

    def _wants_reversible(self, h) -> bool:
        if self.n_rev == 0 or not torch.is_grad_enabled():
            return False
        return h.requires_grad or any(p.requires_grad for layer in self.layers[:self.n_rev] for p in layer.parameters())

    def layer_forward(self, layer, i, h, attn_kwargs):
        d = self.hidden_size
        if self.form is ADAPTERS_ONLY:
            return self.block(layer, "layer", h, attn_kwargs)
        if i == 0:
            self._fused = None
            if h.shape[-1] != d:
                raise RuntimeError(f"slimfit.reversible: layer 0 expects width {d}, got {h.shape[-1]}")
            self._compute_dtype = h.dtype
            if self._wants_reversible(h):
                attn_kwargs = self._drop_cache(attn_kwargs)
                static, names, tensors = split_tensors(attn_kwargs)
                params = [p for layer_ in self.layers[:self.n_rev] for p in self.trainable(layer_)]
                state = ReversibleStack.apply(self, static, names, h, *tensors, *params)
                self._fused = weakref.ref(state)
            else:
                x = h if self.stream_dtype in (None, h.dtype) else h.to(self.stream_dtype)
                state = self._plain(layer, 0, x, x, attn_kwargs)
        else:
            if h.shape[-1] != 2 * d:
                raise RuntimeError(
                    f"slimfit.reversible: layer {i} expects the MEFT pair (width {2 * d}), got width {h.shape[-1]}; "
                    "converted layers must run in order, starting with layer 0, inside the model's own loop")
            fused = self._fused() if self._fused is not None else None
            if i < self.n_rev and fused is h:
                state = h
            else:
                x1, x2 = h.chunk(2, dim=-1)
                state = self._plain(layer, i, x1, x2, attn_kwargs)
        if i == len(self.layers) - 1:
            self._fused = None
            x1, x2 = state.chunk(2, dim=-1)
            out = (x1 + x2) / 2 if self.output == "mean" else (x1, x2)[self.form.last]
            return out if out.dtype == self._compute_dtype else out.to(self._compute_dtype)
        return state

    @staticmethod
    def _drop_cache(attn_kwargs):
        # transformers renamed the layer's cache argument (past_key_value -> past_key_values -> cache in
        # 5.24); a cache left in place would append this forward's keys, and the backward recompute would
        # then attend over them twice: drop it under whichever name the layer takes (known names, or any
        # argument that is a transformers Cache, so a future rename cannot bring the bug back)
        names = [n for n, v in attn_kwargs.items()
                 if v is not None and (n in CACHE_ARGUMENTS or hasattr(v, "get_seq_length"))]
        if not names:
            return attn_kwargs
        out = dict(attn_kwargs)
        for name in names:
            cache = out[name]
            length = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
            if length:
                raise NotImplementedError(
                    "slimfit.reversible: training through a reversible stack with a non-empty key/value cache is "
                    "not supported (the backward pass recomputes each layer)")
            out[name] = None  # nothing is cached while training reversibly
        return out


class MeftLayerMixin:
    """Forward of a converted layer; the arguments are those of the original layer class."""

    def forward(self, hidden_states, *args, **kwargs):
        state = self.__dict__[STATE]
        if getattr(self, "gradient_checkpointing", False) and self.training:
            raise RuntimeError("slimfit.reversible: gradient checkpointing is on for a MEFT-converted layer; "
                               "MEFT already recomputes in backward — turn it off "
                               "(model.gradient_checkpointing_disable())")
        plan = state["plan"]
        attn_kwargs = plan.family.bind(state["original_class"].forward, self, hidden_states, args, kwargs)
        return plan.layer_forward(self, state["index"], hidden_states, attn_kwargs)


def _meft_class(original: type) -> type:
    # slimfit.patch's cached subclass factory (published by name for pickling): SlimFit<Layer>
    return patched_class(original, MeftLayerMixin)


def _find_layers(model: nn.Module):
    """(path, ModuleList, family) of the one list of supported transformer layers in `model`."""
    found = []
    for path, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            layouts = {layout_of_layer(layer) for layer in mod}
            if len(layouts) == 1 and None not in layouts:
                found.append((path, mod, layouts.pop()))
    if not found:
        raise UnsupportedModel(
            f"slimfit.reversible: {type(model).__name__} is not supported: no list of transformer layers of a "
            f"supported family was found. Supported: {SUPPORTED} (and the task-head models built on them, "
            "e.g. BertForSequenceClassification, GPT2LMHeadModel)")
    if len(found) > 1:
        raise UnsupportedModel(
            f"slimfit.reversible: {type(model).__name__} has {len(found)} layer stacks "
            f"({', '.join(p for p, _, _ in found)}); only single-stack encoders/decoders are supported")
    return found[0]


def _check_int(name, value, low, high=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"slimfit.reversible: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"slimfit.reversible: {name} must be {bound}, got {value}")


def _head_parameters(model: nn.Module) -> set:
    """ids of the task head's parameters: outside the base model, plus the base model's pooler."""
    base = getattr(model, "base_model", model)
    base_ids = {id(p) for p in base.parameters()} if base is not model else set()
    head = {id(p) for p in model.parameters() if base is not model and id(p) not in base_ids}
    pooler = getattr(base, "pooler", None)
    if isinstance(pooler, nn.Module):
        head |= {id(p) for p in pooler.parameters()}
    return head


def _check_arguments(model, bottleneck, init_std, stream_dtype, output) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"slimfit.reversible: expected a torch.nn.Module, got {type(model).__name__}")
    if hasattr(model, MODEL_STATE):
        raise RuntimeError("slimfit.reversible: this model is already converted; "
                           "call slimfit.reversible.unconvert first")
    _check_int("bottleneck", bottleneck, 1)
    if output not in ("mean", "last"):
        raise ValueError(f"slimfit.reversible: output must be 'mean' (the paper's (x1 + x2)/2) or 'last', "
                         f"got {output!r}")
    if stream_dtype is not None and not (isinstance(stream_dtype, torch.dtype) and stream_dtype.is_floating_point):
        raise TypeError(f"slimfit.reversible: stream_dtype must be None or a floating torch.dtype, "
                        f"got {stream_dtype!r}")
    if not (isinstance(init_std, (int, float)) and init_std >= 0):
        raise ValueError(f"slimfit.reversible: init_std must be a number >= 0, got {init_std!r}")


def _form_with_scales(form: Form, scales) -> Form:
    """`form` with the (λ, β) of `scales` (finite, non-zero), or as it is for scales None."""
    if scales is None:
        return form
    lam, beta = scales
    for nm, v in (("λ", lam), ("β", beta)):
        if (not isinstance(v, (int, float)) or isinstance(v, bool) or not (v == v) or v == 0
                or abs(v) == float("inf")):
            raise ValueError(f"slimfit.reversible: {nm} must be a finite non-zero number, got {v!r}")
    return dataclasses.replace(form, lam=float(lam), beta=float(beta))


def _check_layers(layers, family, bottleneck) -> int:
    """The layers' hidden size, once each layer is checked convertible and `bottleneck` fits in it."""
    for layer in layers:
        family.check(layer)
        if getattr(layer, "gradient_checkpointing", False):
            raise RuntimeError("slimfit.reversible: gradient checkpointing is enabled; MEFT recomputes in backward "
                               "by itself — call model.gradient_checkpointing_disable() first")
    hidden = family.hidden_size(layers[0])
    if bottleneck > hidden:
        raise ValueError(f"slimfit.reversible: bottleneck {bottleneck} is larger than the hidden size {hidden}")
    return hidden


def _add_adapters_and_swap_classes(plan, path: str, bottleneck, init_std) -> list[str]:
    """Each layer of the plan gets its form's adapters and the MEFT forward; returns the adapters' names."""
    family, form, adapters = plan.family, plan.form, []
    for i, layer in enumerate(plan.layers):
        ref = next(layer.parameters())
        for slot in form.adapters:
            ad = Adapter(plan.hidden_size, bottleneck, family.adapter_activation(layer), family.adapter_dropout(layer),
                         init_std)
            ad.to(device=ref.device, dtype=ref.dtype)
            ad.train(layer.training)
            layer.add_module(slot, ad)
            adapters.append(f"{path}.{i}.{slot}")
        for slot in ADAPTER_NAMES:
            if slot not in form.adapters and not hasattr(layer, slot):
                setattr(layer, slot, None)
        layer.__dict__[STATE] = {"plan": plan, "index": i, "original_class": type(layer)}
        layer.__class__ = _meft_class(type(layer))
    return adapters


def _convert(model, form: Form, bottleneck, reversible_layers, freeze_base, init_std, scales,
             stream_dtype=None, output="mean"):
    _check_arguments(model, bottleneck, init_std, stream_dtype, output)
    path, layers, family = _find_layers(model)
    n = len(layers)
    if reversible_layers is None:
        reversible_layers = n if form is not ADAPTERS_ONLY else 0
    _check_int("reversible_layers", reversible_layers, 0, n)
    form = _form_with_scales(form, scales)
    hidden = _check_layers(layers, family, bottleneck)

    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    plan = Plan(family, form, layers, reversible_layers, hidden, stream_dtype, output)
    adapters = _add_adapters_and_swap_classes(plan, path, bottleneck, init_std)

    head = _head_parameters(model)
    if freeze_base:
        for name, p in model.named_parameters():
            p.requires_grad_(id(p) in head or ".meft_" in f".{name}")
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    summary = MeftSummary(
        model_class=type(model).__name__, family=family.name, form=form.name, lam=form.lam, beta=form.beta,
        swap=form.swap, layers=n, reversible_layers=reversible_layers, bottleneck=bottleneck, layer_path=path,
        output=output, stream_dtype=str(stream_dtype).replace("torch.", "") if stream_dtype else "model dtype",
        adapters=adapters, trainable=trainable,
        trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        total_params=sum(p.numel() for p in model.parameters()))
    model.__dict__[MODEL_STATE] = {"plan": plan, "flags": flags, "summary": summary, "layers": layers}
    return model, summary


def convert(model: nn.Module, form: str = "meft1", bottleneck: int = 8, reversible_layers: int | None = None,
            freeze_base: bool = True, init_std: float = 0.02, scales: tuple | None = None,
            stream_dtype: torch.dtype | None = None, output: str = "mean"):
    """Convert a BERT-family or GPT-2 model in place to MEFT1/2/3; returns (model, summary).

    form: "meft1" (F = layer + FFN-parallel adapter, G = adapter, λ=0.1, β=1, swapped),
          "meft2" (F = adapter, G = layer + adapter, λ=1, β=0.1, swapped),
          "meft3" (F = attention block + adapter, G = MLP block + adapter, λ=β=0.1, not swapped).
    bottleneck: adapter width (8 in the paper). init_std: adapter weight init N(0, init_std²).
    reversible_layers: None = all; n = only the lowest n layers use the reversible backward
        (0 = the same network with plain autograd).
    freeze_base: only adapters and the task head (classifier, pooler, score, ...) keep requires_grad.
    scales: (λ, β) to override the form's defaults (non-zero).
    stream_dtype: dtype of the two residual streams x1, x2 (None = the model's). F and G still
        compute in the model's dtype; torch.float64 makes the reconstruction error of the
        reversible backward ~10^9 times smaller at the cost of one fp64 pair kept for backward.
    output: "mean" = (x1 + x2)/2 as in the paper; "last" = only the half that carries the last
        pretrained block's output (y1 for MEFT1, y2 for MEFT2/3): nearer the pretrained model at init."""
    if not isinstance(form, str) or form.lower() not in FORMS:
        raise ValueError(f"slimfit.reversible: form must be one of {', '.join(FORMS)}, got {form!r}")
    return _convert(model, FORMS[form.lower()], bottleneck, reversible_layers, freeze_base, init_std, scales,
                    stream_dtype, output)


def add_adapters(model: nn.Module, bottleneck: int = 8, freeze_base: bool = True, init_std: float = 0.02):
    """The plain-adapter baseline: one adapter parallel to each layer's FFN
    (mlp(u) = LN(u + FFN(u) + adapter(u)) in BERT, u + MLP(ln_2 u) + adapter(ln_2 u) in GPT-2), no
    duplicated stream, ordinary autograd. Returns (model, summary); undo with unconvert."""
    return _convert(model, ADAPTERS_ONLY, bottleneck, 0, freeze_base, init_std, None)


def _state(model):
    st = getattr(model, MODEL_STATE, None)
    if st is None:
        raise RuntimeError("slimfit.reversible: this model is not converted (call slimfit.reversible.convert first)")
    return st


def set_reversible_layers(model: nn.Module, n: int | None) -> None:
    """Change how many of the lowest layers use the reversible backward (None = all, 0 = none);
    the network and its outputs stay the same."""
    st = _state(model)
    plan = st["plan"]
    if plan.form is ADAPTERS_ONLY:
        raise ValueError("slimfit.reversible: a plain-adapter model (add_adapters) has no reversible layers")
    n = len(plan.layers) if n is None else n
    _check_int("reversible_layers", n, 0, len(plan.layers))
    plan.n_rev = n
    st["summary"].reversible_layers = n


def summary(model: nn.Module) -> MeftSummary:
    return _state(model)["summary"]


def unconvert(model: nn.Module) -> nn.Module:
    """Remove the adapters, restore the layer classes and every parameter's requires_grad."""
    st = _state(model)
    for layer in st["layers"]:
        layer_state = layer.__dict__.pop(STATE)
        layer.__class__ = layer_state["original_class"]
        for slot in ADAPTER_NAMES:
            if slot in layer._modules:
                del layer._modules[slot]
            elif slot in layer.__dict__:
                del layer.__dict__[slot]
    for name, p in model.named_parameters():
        if name in st["flags"]:
            p.requires_grad_(st["flags"][name])
    del model.__dict__[MODEL_STATE]
    return model


class record_states:
    """Context manager for tests and benchmarks: records each converted layer's input pair in the
    forward pass (`.forward[i] = (x1, x2)`) and, for reversible layers, the pair the backward pass
    reconstructed (`.backward[i]`)."""

    def __init__(self, model: nn.Module):
        self.plan = _state(model)["plan"]

    def __enter__(self) -> _Recorder:
        self.plan.recorder = _Recorder()
        return self.plan.recorder

    def __exit__(self, *exc):
        self.plan.recorder = None
        return False
