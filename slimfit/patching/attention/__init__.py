"""Attention, one room: how slimfit.patch routes a model's attention through slimfit's core.

    hf_attention.py      slimfit's core for one transformers attention call (`attend`): the fused or the
                         materializing path per call (SlimFitConfig.attention.path)
    routes.py            how transformers' calls reach it without changing the model's `_attn_implementation`
                         or its branches (the "sdpa" registry entry and `eager_attention_forward` wrapped, the
                         attention module class-swapped to count forwards and calls)
    torch_attention.py   F.scaled_dot_product_attention calls of a model that is not a transformers attention
                         (timm-style blocks, nn.MultiheadAttention), routed by a thread-local TorchFunctionMode
    disentangled.py      DeBERTa's self-attention, which the model computes itself

slimfit.patch drives the room through `install(model, config, summary, keep)`; slimfit.unpatch through
`remove(module, root)`. docs/attention.md describes the paths.
"""
from __future__ import annotations

from torch import nn

from ..modules import swap, unswap
from ..options import AttentionOptions
from . import disentangled, routes, torch_attention
from .routes import ATTENTION_OPTIONS, CALLS, calls_of

__all__ = ["install", "remove", "calls_of", "ATTENTION_OPTIONS", "CALLS"]



def install(model: nn.Module, config, summary, keep) -> None:
    """Route `model`'s attention through slimfit for `config` (whose `attention` is not None): its
    transformers attention modules when it has them (summary.attention = its implementation), else every
    F.scaled_dot_product_attention call of its forward. `keep(name)` is the patch's name filter."""
    summary.attention = _patch_transformers(model, config, summary, keep)
    if summary.attention is None:  # not a transformers attention: route its F.scaled_dot_product_attention calls
        torch_attention.install(model, config, summary)


def remove(module: nn.Module, root: bool) -> bool:
    """Undo `install` on one module (`root`: the patched model itself, which holds the SDPA router);
    whether it held any of the room's attributes."""
    if root:
        torch_attention.remove(module)
    own = vars(module)  # not getattr: PeftModel forwards unknown attributes to the model it wraps
    found = False
    for attr in (ATTENTION_OPTIONS, CALLS):
        if attr in own:
            found = True
            delattr(module, attr)
    return found


def _patch_transformers(model: nn.Module, config, summary, keep) -> str | None:
    """Route the model's transformers attention modules to slimfit (routes.py); the model keeps its own
    implementation and code paths. Returns the implementation, or None (not a transformers attention:
    the caller routes F.scaled_dot_product_attention calls instead)."""
    hf_config = getattr(model, "config", None)
    current = getattr(hf_config, "_attn_implementation", None)
    if current not in routes.IMPLEMENTATIONS:
        summary.skipped.append(("<attention>", type(model).__name__,
                                f"attention implementation {current!r} is not sdpa/eager "
                                "(or not a transformers model)"))
        return None
    found = _attention_modules(model, keep)
    if not found:
        summary.skipped.append(("<attention>", type(model).__name__, "no attention module found"))
        return None
    options = AttentionOptions.from_config(config)
    saving = config.attention
    for name, module in found:
        if _patch_disentangled(name, module, options, summary):
            continue
        swap(module, routes.AttentionMixin, None)
        setattr(module, ATTENTION_OPTIONS, options)
        setattr(module, CALLS, routes.AttentionCalls())
        routes.ensure_routed(module)
        summary.patched.append((name, "attention", f"qkv {saving.qkv_bits or 'full'}, P {options.probs}"))
        summary.attention_modules.append((name, module))
    return current


def _patch_disentangled(name: str, module: nn.Module, options, summary) -> bool:
    """DeBERTa's disentangled self-attention inside `module` through slimfit's core (disentangled.py), when
    its patch-time probe agrees; False (the module routed as any other) when there is none or it differs."""
    child = disentangled.disentangled_child(module)
    if child is None:
        return False
    child_name, child = child
    full_name = f"{name}.{child_name}" if name else child_name
    disentangled.install(child, options)
    why = disentangled.verify_disentangled(child)
    if why is not None:
        unswap(child)
        for attr in (ATTENTION_OPTIONS, CALLS):
            vars(child).pop(attr, None)
        summary.skipped.append((full_name, type(child).__name__, why))
        return False
    summary.patched.append((full_name, "attention", f"disentangled: qkv {options.qkv_bits or 'full'}, P recomputed"))
    summary.attention_modules.append((full_name, child))
    return True


def _attention_modules(model: nn.Module, keep) -> list:
    """The innermost transformers attention modules (class name ending in 'Attention', holding the
    config): the ones that call the attention function with themselves as `module`."""
    found = [(name, module) for name, module in model.named_modules()
             if type(module).__name__.endswith("Attention") and hasattr(module, "config") and not keep(name)]
    inner = {id(module) for _, module in found}
    return [(name, module) for name, module in found
            if not any(id(sub) in inner for sub in module.modules() if sub is not module)]
