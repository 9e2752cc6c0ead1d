"""The table `patch()` asks for each module: which handler takes it, and what that handler does.

A `Handler` is one row: a match predicate (on the module, its class or class name, and the patch
context: config, family, class knowledge of every family), a reason to leave a matching module alone
(`skip`), the mixin to assign (`modules.patched_class(type(module), mixin)`), a function building its
typed options (`slimfit.patch.options`) from the SlimFitConfig, and the summary's mode text. The first
handler whose predicate matches takes the module; a module no handler matches is left alone silently.

`HANDLERS` is the built-in table, in the order the kinds are tried; `register(handler, before=...)`
inserts one (tests, user code), `unregister` removes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from ..autograd.norm_cache import NormCache
from ..config import SlimFitConfig
from . import families
from .modules import (
    OPTIONS,
    ORIGINAL_CLASS,
    Conv1DMixin,
    ConvMixin,
    DropoutMixin,
    GELUMixin,
    LayerNormMixin,
    LinearMixin,
    RMSNormMixin,
    SiLUMixin,
    SwiGLUMixin,
    patched_class,
)
from .options import (
    ActivationOptions,
    ConvOptions,
    DropoutOptions,
    GELUOptions,
    LinearOptions,
    NormOptions,
    Sampling,
)
from .sampling import NORM_CACHE
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

    @property
    def norms_full(self) -> bool:
        return self.config.layernorm == "full" and self.config.layernorm_frozen == "full"


@dataclass(frozen=True)
class Handler:
    kind: str  # the summary's kind ('linear', 'gelu', ...)
    matches: Callable[[nn.Module, PatchContext], bool]
    mixin: type | None = None  # None: a handler that only ever skips
    options: Callable | None = None  # (ctx, name, module) -> the options dataclass
    describe: Callable | None = None  # (ctx, options) -> the summary's mode text
    skip: Callable | None = None  # (ctx, module) -> None (patch it) or a reason (QUIET: no summary line)
    on_patch: Callable | None = None  # (ctx, module, options) -> None, after the class swap


def swap(module: nn.Module, mixin: type, options) -> None:
    original = type(module)
    setattr(module, ORIGINAL_CLASS, original)
    setattr(module, OPTIONS, options)
    module.__class__ = patched_class(original, mixin)


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
                             ("GELUTanh", "tanh"), ("PytorchGELUTanh", "tanh")):
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


def conv1d_class():
    try:
        from transformers.pytorch_utils import Conv1D

        return Conv1D
    except ImportError:
        return None


# -- linear (nn.Linear, MHA's out_proj, GPT-2's Conv1D) -------------------------------------------------

def _is_linear(module, ctx) -> bool:
    cls = type(module)
    return cls is nn.Linear or cls.__name__ == "NonDynamicallyQuantizableLinear"


def _is_conv1d(module, ctx) -> bool:
    return ctx.conv1d is not None and type(module) is ctx.conv1d


def _linear_options(ctx: PatchContext, name: str, module) -> LinearOptions:
    config, family = ctx.config, ctx.family
    is_ffn_out = family is not None and family.is_ffn_out(name)
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


def _swiglu_skip(ctx: PatchContext, module) -> str | None:
    if ctx.config.silu_bits is None:
        return "silu_bits=None (SwiGLU product saved as in PyTorch)"
    act_fn = getattr(module, "act_fn", None)
    if type(act_fn) not in ctx.silu_classes:
        return (f"act_fn is {type(act_fn).__name__}, not SiLU: MLP left as is (its activation is patched on its "
                "own if slimfit knows it)")
    return None


def _claim_act_fn(ctx: PatchContext, module, options) -> None:
    ctx.claimed.add(id(module.act_fn))  # the MLP computes silu(gate) itself: its act_fn is not patched


# -- norms, conv, dropout ----------------------------------------------------------------------------------

def _norm_mode(ctx: PatchContext, opts: NormOptions) -> str:
    return f"{opts.save}/{opts.save_frozen} when frozen"


def _conv_skip(ctx: PatchContext, module) -> str | None:
    if module.padding_mode != "zeros" or module.padding == "same":
        return (f"padding {module.padding!r} / padding_mode {module.padding_mode!r}: left alone (the fast path "
                "needs zero padding)")
    return None


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_RMSNORM_UNKNOWN = "RMSNorm variant whose formula slimfit does not know (saved as in PyTorch)"


def _unknown_reason(ctx: PatchContext, module) -> str:
    return ctx.not_compressed.get(type(module).__name__, _RMSNORM_UNKNOWN)


def _linear_handler(matches, mixin) -> Handler:
    return Handler("linear", matches, mixin, _linear_options, _linear_mode, on_patch=_linear_cache)


HANDLERS: list = [
    _linear_handler(_is_linear, LinearMixin),
    _linear_handler(_is_conv1d, Conv1DMixin),
    Handler("gelu", lambda module, ctx: type(module) in ctx.gelu_kinds, GELUMixin, _gelu_options,
            lambda ctx, opts: f"{opts.bits}-bit input ({opts.approximate})",
            skip=lambda ctx, module: "gelu_bits=None" if ctx.config.gelu_bits is None else None),
    Handler("silu", lambda module, ctx: type(module) in ctx.silu_classes, SiLUMixin,
            lambda ctx, name, module: ActivationOptions.from_config(ctx.config),
            lambda ctx, opts: f"{opts.bits}-bit input",
            skip=lambda ctx, module: "silu_bits=None" if ctx.config.silu_bits is None else None),
    Handler("swiglu", lambda module, ctx: type(module).__name__ in ctx.swiglu_mlps, SwiGLUMixin,
            lambda ctx, name, module: ActivationOptions.from_config(ctx.config),
            lambda ctx, opts: f"gate and up {opts.bits}-bit", skip=_swiglu_skip, on_patch=_claim_act_fn),
    Handler("layernorm", lambda module, ctx: type(module) is nn.LayerNorm, LayerNormMixin,
            lambda ctx, name, module: NormOptions.from_config(ctx.config), _norm_mode,
            skip=lambda ctx, module: "layernorm saves in full" if ctx.norms_full else None),
    Handler("rmsnorm", lambda module, ctx: type(module).__name__ in ctx.rmsnorms, RMSNormMixin,
            lambda ctx, name, module: NormOptions.from_config(ctx.config), _norm_mode,
            skip=lambda ctx, module: ("layernorm saves in full (RMSNorm saved as in PyTorch)" if ctx.norms_full
                                      else None)),
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
