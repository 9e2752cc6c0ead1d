"""The table `patch()` asks for each module: which handler takes it, and what that handler does.

A `Handler` is one row: a match predicate (on the module, its class or class name, and the patch
context: config, family, class knowledge of every family), a reason to leave a matching module alone
(`skip`), the mixin to assign (`modules.patched_class(type(module), mixin)`), a function building its
typed options (`slimfit.patching.options`) from the SlimFitConfig, and the summary's mode text. The first
handler whose predicate matches takes the module; a module no handler matches is left alone silently.

`HANDLERS` is the built-in table, in the order the kinds are tried; `register(handler, before=...)`
inserts one (tests, user code), `unregister` removes it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..autograd.norm_cache import NormCache
from ..config import SlimFitConfig
from . import families
from .experts import ExpertsMixin, is_fused_experts, verify_experts
from .modules import (
    OPTIONS,
    ORIGINAL_CLASS,
    Conv1DMixin,
    ConvMixin,
    DropoutMixin,
    FusedGeGLUMixin,
    FusedSwiGLUMixin,
    GeGLUMixin,
    GELUMixin,
    LayerNormMixin,
    LayerScaleMixin,
    LinearMixin,
    ParamFreeLayerNormMixin,
    ReLUMixin,
    RMSNormMixin,
    SiLUMixin,
    SwiGLUMixin,
    swap,
    unswap,
)
from .options import (
    ActivationOptions,
    ConvOptions,
    DropoutOptions,
    ExpertsOptions,
    GeGLUOptions,
    GELUOptions,
    LayerScaleOptions,
    LinearOptions,
    NormOptions,
    ReLUOptions,
    Sampling,
)
from .sampling import NORM_CACHE
from .structure import (
    activation_attribute,
    agrees,
    fused_gated_names,
    gated_mlp_layout,
    is_rmsnorm_shaped,
    norm_epsilon,
    probe_input,
    random_weight,
)
from .summary import PatchSummary

QUIET = ""  # a skip reason that leaves the module alone without a line in the summary


@dataclass
class PatchContext:
    """What the handlers of one patch() call share."""

    config: SlimFitConfig
    family: families.Family | None
    sample_ids: object = None  # sampling.SampleIds when config.sampling, else None
    claimed: set = field(default_factory=set)  # ids of modules a patched parent computes itself
    swiglu_mlps: frozenset = field(default_factory=lambda: families.known_classes("swiglu_mlps"))
    rmsnorms: frozenset = field(default_factory=lambda: families.known_classes("rmsnorms"))
    not_compressed: dict = field(default_factory=families.not_compressed)
    # transformers' classes, looked up per patch (transformers may be imported after a first patch)
    gelu_kinds: dict = field(default_factory=lambda: gelu_kinds())
    silu_classes: tuple = field(default_factory=lambda: silu_classes())
    conv1d: type | None = field(default_factory=lambda: conv1d_class())
    ffn_out: frozenset = frozenset()  # ids of the MLP output projections found by structure (ffn_output_linears)

    @property
    def norms_full(self) -> bool:
        return self.config.norm_save(frozen=False) == "full" and self.config.norm_save(frozen=True) == "full"


@dataclass(frozen=True)
class Handler:
    kind: str  # the summary's kind ('linear', 'gelu', ...)
    matches: Callable[[nn.Module, PatchContext], bool]
    mixin: type | None = None  # None: a handler that only ever skips
    options: Callable | None = None  # (ctx, name, module) -> the options dataclass
    describe: Callable | None = None  # (ctx, options) -> the summary's mode text
    skip: Callable | None = None  # (ctx, module) -> None (patch it) or a reason (QUIET: no summary line)
    on_patch: Callable | None = None  # (ctx, module, options) -> None, after the class swap
    # (ctx, module) -> None when the swapped module's forward agrees with its original on a probe input
    # (structure.agrees), else the reason it is left alone; the swap is undone then
    verify: Callable | None = None


def handle(name: str, module: nn.Module, ctx: PatchContext, summary: PatchSummary) -> None:
    """Patch (or record why not) one selected module with the first handler that matches it."""
    handler = next((candidate for candidate in HANDLERS if candidate.matches(module, ctx)), None)
    if handler is None:
        return
    reason = handler.skip(ctx, module) if handler.skip is not None else None
    if reason is not None:
        if reason:
            summary.skipped.append((name, type(module).__name__, reason))
        return
    options = handler.options(ctx, name, module)
    swap(module, handler.mixin, options)
    reason = handler.verify(ctx, module) if handler.verify is not None else None
    if reason is not None:
        unswap(module)
        summary.skipped.append((name, type(module).__name__, reason))
        return
    options = getattr(module, OPTIONS)  # verify may have chosen a variant (an RMSNorm's weight offset)
    if handler.on_patch is not None:
        handler.on_patch(ctx, module, options)
    summary.patched.append((name, handler.kind, handler.describe(ctx, options)))


def register(handler: Handler, before: str | None = None) -> Handler:
    """Insert `handler` before the first handler of kind `before` (default: at the end of the table)."""
    index = next((i for i, existing in enumerate(HANDLERS) if existing.kind == before), len(HANDLERS))
    HANDLERS.insert(index, handler)
    return handler


def unregister(handler: Handler) -> None:
    HANDLERS.remove(handler)


# -- what transformers adds to PyTorch's classes -----------------------------------------------------------

def gelu_kinds() -> dict:
    """Exact activation classes -> 'none' | 'tanh' (the approximation they compute; None: the module's)."""
    kinds = {nn.GELU: None}
    try:
        from transformers import activations

        for name, approx in (("GELUActivation", "none"), ("NewGELUActivation", "tanh"),
                             ("GELUTanh", "tanh"), ("PytorchGELUTanh", "tanh"), ("QuickGELUActivation", "quick")):
            if hasattr(activations, name):
                kinds[getattr(activations, name)] = approx
    except ImportError:
        pass
    return kinds


def silu_classes() -> tuple:
    classes = [nn.SiLU]
    try:
        from transformers.activations import SiLUActivation

        classes.append(SiLUActivation)
    except ImportError:
        pass
    return tuple(classes)


def activation_classes(ctx: PatchContext) -> tuple:
    """Every activation class slimfit knows (GELUs, SiLUs, ReLU): an MLP's activation child."""
    return (*ctx.gelu_kinds, *ctx.silu_classes, nn.ReLU)


def conv1d_class():
    try:
        from transformers.pytorch_utils import Conv1D

        return Conv1D
    except ImportError:
        return None


# -- linear (nn.Linear, MHA's out_proj, GPT-2's Conv1D) -------------------------------------------------

def _is_linear(module, ctx) -> bool:
    return isinstance(module, nn.Linear)


def _verify_linear(ctx: PatchContext, module) -> str | None:
    """nn.Linear itself is known; a subclass (FalconLinear, quantized linears) is taken only when its
    forward agrees with slimfit's linear on a probe input."""
    original = vars(module)[ORIGINAL_CLASS]
    if original is nn.Linear or original.forward is nn.Linear.forward:
        return None
    if agrees(module, original, probe_input(module.in_features, module.weight)):
        return None
    return (f"an nn.Linear subclass whose forward differs from F.linear on a probe input (quantized or "
            f"modified weights?): {original.__name__} left as is")


def _is_conv1d(module, ctx) -> bool:
    return ctx.conv1d is not None and type(module) is ctx.conv1d


def _linear_options(ctx: PatchContext, name: str, module) -> LinearOptions:
    config, family = ctx.config, ctx.family
    is_ffn_out = id(module) in ctx.ffn_out or (family is not None and family.is_ffn_out(name))
    bits = config.ffn_out_input_bits if (is_ffn_out and config.ffn_out_input_bits) else config.linear_input_bits
    sampling = None
    if ctx.sample_ids is not None and _is_sample_target(config, family, name):
        settings = config.sampling
        sampling = Sampling(sampler=settings.method, ratio=float(settings.ratio), k_min=settings.min_rows,
                            ids=ctx.sample_ids, name=name)
    return LinearOptions.from_config(config, bits, sampling)


def _is_sample_target(config: SlimFitConfig, family, name: str) -> bool:
    """Whether the linear `name` gets sampled weight gradients: every one for sampling.targets='all';
    for 'paper', the family's attention-output and FFN linears. Under PEFT LoRA, a target's
    base_layer (frozen: fast path anyway) and lora_A (its input is the full-width activation) are
    sampled, lora_B (input: r values per token) is not."""
    if config.sampling.targets == "all":
        return True
    return family is not None and family.is_sample_target(name)


def _linear_mode(ctx: PatchContext, opts: LinearOptions) -> str:
    bits = opts.input_bits
    mode = f"input {bits or 'full'}{'-bit' if bits else ''}"
    if opts.sampling is not None:
        mode += f", {ctx.config.sampling.method} {ctx.config.sampling.ratio:.0%} of rows"
    return mode + ", frozen fast path"


def _linear_cache(ctx: PatchContext, module, opts: LinearOptions) -> None:
    if opts.sampling is not None:
        setattr(module, NORM_CACHE, NormCache(per_token=ctx.config.sampling.norms == "token"))


# -- activations -----------------------------------------------------------------------------------------

def _gelu_options(ctx: PatchContext, name: str, module) -> GELUOptions:
    approx = ctx.gelu_kinds[type(module)]
    return GELUOptions.from_config(ctx.config, module.approximate if approx is None else approx)


def _is_gated_mlp(module, ctx) -> bool:
    """gate/up/down projections and an activation child, or a class a family lists (whose forward the
    probe still checks)."""
    if type(module).__name__ in ctx.swiglu_mlps:
        return True
    return gated_mlp_layout(module) == "separate" and activation_attribute(module, (nn.Module,)) is not None


def _is_gelu_gated_mlp(module, ctx) -> bool:
    """gate/up/down projections and an erf or tanh GELU activation child (Gemma's GELU-tanh)."""
    gelus = tuple(cls for cls, approx in ctx.gelu_kinds.items() if approx != "quick")
    return gated_mlp_layout(module) == "separate" and activation_attribute(module, gelus) is not None


def _is_fused_gelu_gated_mlp(module, ctx) -> bool:
    """One linear producing [gate, up], the down projection and an erf or tanh GELU activation child
    (ModernBERT)."""
    gelus = tuple(cls for cls, approx in ctx.gelu_kinds.items() if approx != "quick")
    return gated_mlp_layout(module) == "fused" and activation_attribute(module, gelus) is not None


def _geglu_options(ctx: PatchContext, name: str, module) -> GeGLUOptions:
    gelus = tuple(cls for cls, approx in ctx.gelu_kinds.items() if approx != "quick")
    act = getattr(module, activation_attribute(module, gelus))
    approx = ctx.gelu_kinds[type(act)]
    return GeGLUOptions.from_config(ctx.config, act.approximate if approx is None else approx)


def _claim_gelu_act(ctx: PatchContext, module, options) -> None:
    # the MLP computes gelu(gate) itself: its activation child is not patched
    gelus = tuple(cls for cls, approx in ctx.gelu_kinds.items() if approx != "quick")
    ctx.claimed.add(id(getattr(module, activation_attribute(module, gelus))))


def _is_fused_gated_mlp(module, ctx) -> bool:
    """A fused gate_up projection ([gate, up] along the last dimension), down_proj and an activation child."""
    return gated_mlp_layout(module) == "fused" and activation_attribute(module, (nn.Module,)) is not None


def _swiglu_skip(ctx: PatchContext, module) -> str | None:
    if ctx.config.silu_bits is None:
        return "silu_bits=None (SwiGLU product saved as in PyTorch)"
    if activation_attribute(module, ctx.silu_classes) is None:
        attribute = activation_attribute(module, (nn.Module,))
        return (f"{attribute} is {type(getattr(module, attribute)).__name__}, not SiLU: gated MLP left as is (its "
                "activation is patched on its own if slimfit knows it)")
    return None


def _verify_mlp(ctx: PatchContext, module) -> str | None:
    original = vars(module)[ORIGINAL_CLASS]
    layout = gated_mlp_layout(module)
    first = getattr(module, fused_gated_names(module)[0]) if layout == "fused" else module.gate_proj
    if agrees(module, original, probe_input(first.in_features, first.weight)):
        return None
    return ("gated-MLP-shaped, but its forward differs from down(act(gate(x)) * up(x)) on a probe input: "
            "left as is (its linears are patched on their own)")


def _claim_act_fn(ctx: PatchContext, module, options) -> None:
    # the MLP computes silu(gate) itself: its activation child is not patched
    ctx.claimed.add(id(getattr(module, activation_attribute(module, ctx.silu_classes))))


# -- norms, conv, dropout ----------------------------------------------------------------------------------

def _norm_mode(ctx: PatchContext, opts: NormOptions) -> str:
    return f"{opts.save}/{opts.save_frozen} when frozen"


def _conv_skip(ctx: PatchContext, module) -> str | None:
    if module.padding_mode != "zeros" or module.padding == "same":
        return (f"padding {module.padding!r} / padding_mode {module.padding_mode!r}: left alone (the fast path "
                "needs zero padding)")
    return None


def _is_rmsnorm(module, ctx) -> bool:
    return type(module).__name__ in ctx.rmsnorms or is_rmsnorm_shaped(module)


def _rmsnorm_options(ctx: PatchContext, name: str, module) -> NormOptions:
    return NormOptions.from_config(ctx.config, eps_attribute=norm_epsilon(module) or "variance_epsilon")


def _verify_rmsnorm(ctx: PatchContext, module) -> str | None:
    """Llama's formula, or Gemma's (1 + w): whichever agrees with the module on a probe input."""
    original, opts = vars(module)[ORIGINAL_CLASS], getattr(module, OPTIONS)
    x = probe_input(module.weight.shape[0], module.weight)
    # random weights for the probe: at initialisation (all ones, all zeros) formulas coincide
    with random_weight(module.weight):
        for offset in (0.0, 1.0):
            setattr(module, OPTIONS, dataclasses.replace(opts, weight_offset=offset))
            if agrees(module, original, x):
                return None
    return _RMSNORM_UNKNOWN


# Epsilons a parameter-free LayerNorm may hard-code (OLMo: 1e-5); the probe keeps the one that agrees.
PARAM_FREE_EPSILONS = (1e-5, 1e-6, 1e-12, 1e-8, 1e-7)


def _is_param_free_layernorm(module, ctx) -> bool:
    """A leaf with a `normalized_shape` of one dimension and no parameters or buffers (OLMo's LayerNorm)."""
    shape = getattr(module, "normalized_shape", None)
    return (isinstance(shape, tuple) and len(shape) == 1 and isinstance(shape[0], int)
            and not any(True for _ in module.children()) and not any(True for _ in module.parameters())
            and not any(True for _ in module.buffers()))


def _verify_param_free_layernorm(ctx: PatchContext, module) -> str | None:
    """The epsilon at which the fp32 LayerNorm formula agrees with the module on fp32 and bf16 probes."""
    original, opts = vars(module)[ORIGINAL_CLASS], getattr(module, OPTIONS)
    like = torch.empty(0)
    probes = [probe_input(module.normalized_shape[0], like.to(dtype)) for dtype in (torch.float32, torch.bfloat16)]
    for eps in PARAM_FREE_EPSILONS:
        setattr(module, OPTIONS, dataclasses.replace(opts, eps=eps))
        if all(agrees(module, original, x) for x in probes):
            return None
    return "LayerNorm-shaped without weight, but its output differs from the fp32 LayerNorm formula: left as is"


def _rmsnorm_mode(ctx: PatchContext, opts: NormOptions) -> str:
    return _norm_mode(ctx, opts) + (", weight 1 + w" if opts.weight_offset else "")


def _is_layer_scale(module, ctx) -> bool:
    """A leaf named like a scale whose one parameter is a 1-D vector (DINOv2's lambda1, ConvNeXt's gamma)."""
    params = dict(module.named_parameters(recurse=False))
    return (len(params) == 1 and next(iter(params.values())).dim() == 1 and not any(True for _ in module.children())
            and "scale" in type(module).__name__.lower())


def _layer_scale_options(ctx: PatchContext, name: str, module) -> LayerScaleOptions:
    (attribute,) = dict(module.named_parameters(recurse=False))
    return LayerScaleOptions.from_config(ctx.config, attribute)


def _verify_layer_scale(ctx: PatchContext, module) -> str | None:
    weight = getattr(module, getattr(module, OPTIONS).weight_attribute)
    with random_weight(weight):
        if agrees(module, vars(module)[ORIGINAL_CLASS], probe_input(weight.shape[0], weight)):
            return None
    return "scale-shaped, but its forward differs from x * w on a probe input: left as is"


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_RMSNORM_UNKNOWN = ("a norm (one 1-D weight, an epsilon) whose formula slimfit does not know: neither w nor "
                    "1 + w times x * rsqrt(mean(x²) + eps) matches its forward on a probe input (saved as in PyTorch)")


def _unknown_reason(ctx: PatchContext, module) -> str:
    return ctx.not_compressed.get(type(module).__name__, _RMSNORM_UNKNOWN)


def _linear_handler(matches, mixin) -> Handler:
    return Handler("linear", matches, mixin, _linear_options, _linear_mode, on_patch=_linear_cache)


HANDLERS: list = [
    Handler("linear", _is_linear, LinearMixin, _linear_options, _linear_mode, on_patch=_linear_cache,
            verify=_verify_linear),
    _linear_handler(_is_conv1d, Conv1DMixin),
    Handler("gelu", lambda module, ctx: type(module) in ctx.gelu_kinds, GELUMixin, _gelu_options,
            lambda ctx, opts: f"{opts.bits}-bit input ({opts.approximate})",
            skip=lambda ctx, module: "gelu_bits=None" if ctx.config.gelu_bits is None else None),
    Handler("experts", lambda module, ctx: is_fused_experts(module, ctx.silu_classes), ExpertsMixin,
            lambda ctx, name, module: ExpertsOptions.from_config(ctx.config),
            lambda ctx, opts: (f"fused experts: projections as linears (frozen: nothing saved), gate and up "
                               f"{opts.product.bits}-bit, routed rows "
                               f"{'in full' if opts.routing.bits is None else f'{opts.routing.bits}-bit'}"),
            skip=lambda ctx, module: "silu_bits=None (experts saved as in PyTorch)" if ctx.config.silu_bits is None
            else None,
            on_patch=lambda ctx, module, options: ctx.claimed.add(id(module.act_fn)), verify=verify_experts),
    Handler("silu", lambda module, ctx: type(module) in ctx.silu_classes, SiLUMixin,
            lambda ctx, name, module: ActivationOptions.from_config(ctx.config),
            lambda ctx, opts: f"{opts.bits}-bit input",
            skip=lambda ctx, module: "silu_bits=None" if ctx.config.silu_bits is None else None),
    Handler("geglu", _is_gelu_gated_mlp, GeGLUMixin, _geglu_options,
            lambda ctx, opts: f"gate and up {opts.bits}-bit (GELU {opts.approximate})",
            skip=lambda ctx, module: "gelu_bits=None (GeGLU product saved as in PyTorch)"
            if ctx.config.gelu_bits is None else None, on_patch=_claim_gelu_act, verify=_verify_mlp),
    Handler("geglu", _is_fused_gelu_gated_mlp, FusedGeGLUMixin, _geglu_options,
            lambda ctx, opts: f"fused gate-up, gate and up {opts.bits}-bit (GELU {opts.approximate})",
            skip=lambda ctx, module: "gelu_bits=None (GeGLU product saved as in PyTorch)"
            if ctx.config.gelu_bits is None else None, on_patch=_claim_gelu_act, verify=_verify_mlp),
    Handler("swiglu", _is_gated_mlp, SwiGLUMixin,
            lambda ctx, name, module: ActivationOptions.from_config(ctx.config),
            lambda ctx, opts: f"gate and up {opts.bits}-bit", skip=_swiglu_skip, on_patch=_claim_act_fn,
            verify=_verify_mlp),
    Handler("swiglu", _is_fused_gated_mlp, FusedSwiGLUMixin,
            lambda ctx, name, module: ActivationOptions.from_config(ctx.config),
            lambda ctx, opts: f"fused gate_up, gate and up {opts.bits}-bit", skip=_swiglu_skip,
            on_patch=_claim_act_fn, verify=_verify_mlp),
    Handler("layernorm", lambda module, ctx: type(module) is nn.LayerNorm, LayerNormMixin,
            lambda ctx, name, module: NormOptions.from_config(ctx.config), _norm_mode,
            skip=lambda ctx, module: "layernorm saves in full" if ctx.norms_full else None),
    Handler("layernorm", _is_param_free_layernorm, ParamFreeLayerNormMixin,
            lambda ctx, name, module: NormOptions.from_config(ctx.config),
            lambda ctx, opts: f"no weight (eps {opts.eps:g}): x̂ {opts.save_frozen}",
            skip=lambda ctx, module: "layernorm saves in full" if ctx.norms_full else None,
            verify=_verify_param_free_layernorm),
    Handler("rmsnorm", _is_rmsnorm, RMSNormMixin, _rmsnorm_options, _rmsnorm_mode,
            skip=lambda ctx, module: ("layernorm saves in full (RMSNorm saved as in PyTorch)" if ctx.norms_full
                                      else None),
            verify=_verify_rmsnorm),
    Handler("layer scale", _is_layer_scale, LayerScaleMixin, _layer_scale_options,
            lambda ctx, opts: f"input {opts.bits}-bit for the scale's gradient",
            skip=lambda ctx, module: "ffn_out_input_bits=None (saved as in PyTorch)"
            if ctx.config.ffn_out_input_bits is None else None, verify=_verify_layer_scale),
    Handler("relu", lambda module, ctx: type(module) is nn.ReLU, ReLUMixin, lambda ctx, name, module: ReLUOptions(),
            lambda ctx, opts: "1-bit mask (exact)",
            skip=lambda ctx, module: "inplace=True: left as is" if module.inplace else None),
    Handler("conv", lambda module, ctx: type(module) in _CONVS, ConvMixin, lambda ctx, name, module: ConvOptions(),
            lambda ctx, opts: "frozen fast path (trainable: as PyTorch)", skip=_conv_skip),
    Handler("dropout", lambda module, ctx: type(module) is nn.Dropout, DropoutMixin,
            lambda ctx, name, module: DropoutOptions.from_config(ctx.config), lambda ctx, opts: opts.mode,
            skip=lambda ctx, module: QUIET if ctx.config.dropout == "torch" else None),
    # known to be left alone: the family files' not_compressed classes, and RMSNorms of unknown formula
    Handler("not compressed",
            lambda module, ctx: type(module).__name__ in ctx.not_compressed or "RMSNorm" in type(module).__name__,
            skip=_unknown_reason),
]
