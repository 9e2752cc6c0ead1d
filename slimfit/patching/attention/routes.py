"""How a Hugging Face model's attention calls reach slimfit without changing which branch the
model's own code takes.

Models compare `config._attn_implementation` with strings ("sdpa", "eager") and pick a code path
by it (Falcon computes attention inline unless it reads "sdpa"; GPT-2 upcasts only under "eager"),
so slimfit never renames the implementation. Instead, at the two places where transformers looks the
attention function up, the function is wrapped, once per process:

* the "sdpa" entry of transformers' attention registry (`AttentionInterface`), which every modeling
  file consults for a non-eager implementation;
* the module-level `eager_attention_forward` of each modeling file, which its attention modules fall
  back to under "eager" (the name is looked up at call time).

A wrapper runs slimfit's core (`hf_attention.attend`) only for a module slimfit patched, and only
when the call builds a graph; every other call goes to the original function with the very same
arguments, so unpatched models, eval and `torch.no_grad` are untouched. A patched attention module
whose own forward calls `F.scaled_dot_product_attention` directly (Falcon's sdpa branch) has those
calls routed too, by `torch_attention`'s router entered around its forward.

Nothing is claimed without evidence: each patched module counts the forwards that build a graph and
the calls that reached slimfit (`AttentionCalls`); the summary reports them (`summary.py`).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import weakref
from collections import Counter

import torch

from ..modules import ORIGINAL_CLASS
from . import hf_attention

ATTENTION_OPTIONS = "_slimfit_attention"
CALLS = "_slimfit_attention_calls"
IMPLEMENTATIONS = ("sdpa", "eager")  # the implementations whose calls slimfit can take
_WRAPPED = "__slimfit_original__"
# Arguments slimfit's core understands; any other argument the original function names as a parameter
# (sinks, sliding_window) changes the result when given, so such a call goes to the original function and
# is counted as a fallback. A position bias is folded into the mask (_with_position_bias); soft-capping goes
# to the materializing core.
_UNDERSTOOD = {"module", "query", "key", "value", "attention_mask", "dropout", "scaling", "is_causal", "softcap"}


@dataclasses.dataclass
class AttentionCalls:
    """What happened to one patched attention module's calls (Python ints: no host sync)."""

    forwards: int = 0  # forwards run with gradients enabled
    reached: int = 0  # calls that took slimfit's core
    fallbacks: Counter = dataclasses.field(default_factory=Counter)  # reason -> calls left to the original


def calls_of(module) -> AttentionCalls | None:
    return vars(module).get(CALLS)


def _count(module, reason: str | None = None) -> None:
    calls = calls_of(module)
    if calls is None or torch.compiler.is_compiling():  # a compiled graph must not guard on counters
        return
    if reason is None:
        calls.reached += 1
    else:
        calls.fallbacks[reason] += 1


def count_forward(module) -> None:
    """One more forward with gradients of a patched attention module (the summary's `forwards`)."""
    calls = calls_of(module)
    if calls is not None and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        calls.forwards += 1


def _count_ref(ref) -> None:
    module = ref()
    if module is not None:
        _count(module)


def _binder(signature: inspect.Signature):
    """A function (module, args, kwargs) -> the call's arguments by name, as the original function sees them
    (None: it would refuse them), as ``signature.bind`` finds them, in plain dict and tuple steps a compiler
    traces (inspect's binding is not traceable)."""
    params = list(signature.parameters.values())
    kinds = inspect.Parameter
    positional = [p.name for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    keyword = {p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    var_args = any(p.kind is kinds.VAR_POSITIONAL for p in params)
    var_kwargs = any(p.kind is kinds.VAR_KEYWORD for p in params)

    def bind(module, args, kwargs) -> dict | None:
        args = (module, *args)
        if len(args) > len(positional) and not var_args:
            return None
        named = dict(zip(positional, args))
        for name, value in kwargs.items():
            if name in named or (name not in keyword and not var_kwargs):
                return None
            named[name] = value
        return named

    return bind


def _unsupported(signature: inspect.Signature, named: dict) -> str | None:
    """Why slimfit's core would not compute what the original does with these arguments, if so."""
    for name, value in named.items():
        if value is not None and name not in _UNDERSTOOD and name in signature.parameters:
            return f"{name} given (slimfit's core does not apply it)"
    if named.get("softcap") is not None and "softcap" not in signature.parameters:
        # sdpa's function refuses it (through **kwargs), an eager one that does not name it ignores it
        return "softcap given to a function that does not apply it (left to that function)"
    return None


def _with_position_bias(kind: str, module, named: dict) -> dict | None:
    """The call's arguments with an additive position bias (T5, DeBERTa-style) folded into the mask, as the
    original function folds it (sdpa: transformers' create_position_bias_mask after its causal slicing;
    eager: scores + bias + mask); None when that cannot be reproduced here. The bias usually trains, so the
    mask requires grad and the materializing core (which returns the mask's gradient) takes the call."""
    bias, mask = named.pop("position_bias"), named.get("attention_mask")
    query, key, value = named["query"], named["key"], named["value"]
    if kind == "eager":
        if mask is not None and mask.dtype == torch.bool:
            return None
        return {**named, "attention_mask": bias if mask is None else bias + mask, "is_causal": False}
    try:
        from transformers.integrations.sdpa_attention import create_position_bias_mask
    except ImportError:
        return None
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = named.get("is_causal")
    causal = bool(q_len > 1 and mask is None and (getattr(module, "is_causal", True) if causal is None else causal))
    if causal and kv_len > q_len:
        key, value, bias = key[:, :, :q_len], value[:, :, :q_len], bias[:, :, :, :q_len]
    mask = create_position_bias_mask(bias, mask, causal, query, key)
    return {**named, "key": key, "value": value, "attention_mask": mask, "is_causal": False}


def _wrap(original, kind: str):
    """The routing wrapper around one transformers attention function of `kind` ('sdpa' or 'eager')."""
    signature = inspect.signature(original)
    bind = _binder(signature)

    def slimfit_attention(module, *args, **kwargs):
        opts = vars(module).get(ATTENTION_OPTIONS)
        if opts is None:
            return original(module, *args, **kwargs)
        named = bind(module, args, kwargs)
        query, key, value = (named or {}).get("query"), (named or {}).get("key"), (named or {}).get("value")
        if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):  # a call slimfit cannot read
            return original(module, *args, **kwargs)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        # training dropout without a graph (reentrant checkpointing's first pass) still takes slimfit's
        # seeded mask, the one the recompute draws
        seeded = module.training and float(named.get("dropout") or 0.0) > 0.0
        if not (needs_grad or seeded):
            return original(module, *args, **kwargs)
        if named.get("position_bias") is not None:
            named = _with_position_bias(kind, module, named) or named
        why_not = _unsupported(signature, named)
        if why_not is not None:
            _count(module, why_not)
            return original(module, *args, **kwargs)
        _count(module)
        query, key, value = named["query"], named["key"], named["value"]
        return hf_attention.attend(module, opts, query, key, value, named.get("attention_mask"),
                                   dropout=named.get("dropout", 0.0), scaling=named.get("scaling"),
                                   is_causal=named.get("is_causal"), softcap=named.get("softcap"))

    setattr(slimfit_attention, _WRAPPED, original)
    slimfit_attention.__name__ = f"slimfit_{getattr(original, '__name__', 'attention')}"
    return slimfit_attention


def _route_registry() -> None:
    from transformers import AttentionInterface

    current = AttentionInterface._global_mapping.get("sdpa")
    if current is not None and not hasattr(current, _WRAPPED):
        AttentionInterface.register("sdpa", _wrap(current, "sdpa"))


def _route_eager(modeling_module) -> None:
    current = getattr(modeling_module, "eager_attention_forward", None)
    if callable(current) and not hasattr(current, _WRAPPED):
        modeling_module.eager_attention_forward = _wrap(current, "eager")


def ensure_routed(module) -> None:
    """The wrappers this module's calls go through are in place (idempotent: after unpickling in a new
    process, or after `model.set_attn_implementation`, the first forward installs them)."""
    _route_registry()
    original_class = vars(module).get(ORIGINAL_CLASS, type(module))
    modeling_module = sys.modules.get(original_class.__module__)
    if modeling_module is not None:
        _route_eager(modeling_module)


@torch.compiler.assume_constant_result
def _routed(module) -> bool:
    """ensure_routed(module), run by a compiler at trace time (its module lookups and the source it reads are not
    traceable; what it installs is the same at every call)."""
    ensure_routed(module)
    return True


@torch.compiler.assume_constant_result
def _calls_sdpa_directly(cls: type) -> bool:
    """Whether the class's own forward calls F.scaled_dot_product_attention (not through transformers'
    registry); unknown source counts as yes (routing such calls is harmless when there are none)."""
    try:
        return "scaled_dot_product_attention" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True


class AttentionMixin:
    """A patched transformers attention module: counts its forwards with gradients, makes sure the
    wrappers are in place, and routes its own direct F.scaled_dot_product_attention calls."""

    def forward(self, *args, **kwargs):
        original = vars(self)[ORIGINAL_CLASS]
        if not torch.is_grad_enabled() and not self.training:
            return original.forward(self, *args, **kwargs)
        _routed(self)
        count_forward(self)
        router = _direct_router(self, original)
        if router is None:
            return original.forward(self, *args, **kwargs)
        with router:
            return original.forward(self, *args, **kwargs)


_DIRECT: dict = {}  # class -> whether its forward calls SDPA directly


def _direct_router(module, original: type):
    if original not in _DIRECT:
        _DIRECT[original] = _calls_sdpa_directly(original)
    if not _DIRECT[original]:
        return None
    from .torch_attention import module_router

    return module_router(module, vars(module)[ATTENTION_OPTIONS], functools.partial(_count_ref, weakref.ref(module)))

