"""slimfit.patch(model, config): swap the layers of a model in place (same parameters,
same state_dict keys); slimfit.unpatch(model) restores the original behaviour exactly."""
from __future__ import annotations

import warnings

from torch import nn

from ..config import SlimFitConfig
from . import attention, handlers, structure
from .causal_lm import patch_causal_lm, unpatch_causal_lm
from .families import family_for
from .handlers import PatchContext
from .modules import OPTIONS, ORIGINAL_CLASS
from .root_hooks import (
    MODEL_STATE,
    install_new_module_check,
    install_sample_id_hooks,
    install_seed_hook,
    name_filter,
    remove_hooks,
)
from .sampling import NORM_CACHE, SampleIds, norm_caches, sample_ids
from .summary import NOTHING_PATCHED, PatchSummary


def patch(model: nn.Module, config: SlimFitConfig | None = None, *, target_modules=None, exclude_modules=None):
    """Patch `model` in place for `config` (default: SlimFitConfig.paper()) and return it, as peft's
    get_peft_model does; what it did is `model.slimfit_summary` (a PatchSummary).

    target_modules / exclude_modules (as in peft): a list of names, each matching a module whose
    name is that name or ends with '.' + that name, or one string, a regular expression the whole
    name must match. A module is selected when it or a module containing it matches (so
    `exclude_modules=["classifier"]` leaves the classifier and everything in it alone).

    Patching again with the same config re-patches the whole model, picking up modules added since
    (PEFT adapters: `slimfit.patch(get_peft_model(patched, lora), config)` compresses what
    patching after get_peft_model compresses; sampled layers keep their gradient-norm caches). A
    model containing a model patched with another config raises (unpatch first)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"slimfit.patch expects a torch.nn.Module, got {type(model).__name__}")
    config = SlimFitConfig.paper() if config is None else config
    if not isinstance(config, SlimFitConfig):
        raise TypeError(f"slimfit.patch: config must be a SlimFitConfig, got {type(config).__name__}")
    keep = name_filter(target_modules, exclude_modules)
    caches = _release_patched(model, config)

    family = family_for(model)
    summary = PatchSummary(family=family.name if family else "generic", notes=family.notes if family else ())
    holder = SampleIds() if config.sampling is not None else None
    ctx = PatchContext(config, family, sample_ids=holder)
    ctx.ffn_out = structure.ffn_output_linears(model, handlers.activation_classes(ctx))

    for name, module in model.named_modules():  # each selected module: the first handler that matches it
        if ORIGINAL_CLASS in vars(module) or id(module) in ctx.claimed:
            continue
        why_not = keep(name)
        if not why_not:
            handlers.handle(name, module, ctx, summary)
        elif name and not any(True for _ in module.children()):
            summary.skipped.append((name, type(module).__name__, why_not))

    _install_model_level(model, config, summary, keep, holder, family)
    for module in model.modules():  # the sampled layers' stale gradient norms survive a re-patch
        if id(module) in caches and NORM_CACHE in vars(module):
            setattr(module, NORM_CACHE, caches[id(module)])
    install_new_module_check(model)
    if not any(name != "<sdpa>" for name, _, _ in summary.patched):
        warnings.warn(f"slimfit.patch: {NOTHING_PATCHED}" + (
            " (only F.scaled_dot_product_attention calls made in forward, if any, are routed)"
            if summary.sdpa_router is not None else ""), stacklevel=2)
    setattr(model, MODEL_STATE, {"config": config, "summary": summary, "sample_ids": holder,
                                 "filters": (target_modules, exclude_modules)})
    model.slimfit_summary = summary
    return model


def _install_model_level(model: nn.Module, config: SlimFitConfig, summary: PatchSummary, keep, holder,
                         family) -> None:
    """What is patched on the model, not per module: sampling and seed hooks, attention, the LM head."""
    if holder is not None:
        if not any(kind == "linear" and "of rows" in mode for _, kind, mode in summary.patched):
            why = ("sampling.targets='paper' needs a known family (use targets='all')" if family is None
                   else "no linear layer matches the family's sampling targets")
            summary.skipped.append(("<sampling>", type(model).__name__, why))
        install_sample_id_hooks(model)
    if config.stochastic or holder is not None:
        install_seed_hook(model)
    if config.lm_head_chunk_rows is not None:  # first: its patch-time probe forward is no training forward
        patch_causal_lm(model, config.lm_head_chunk_rows, summary)
    if config.attention is not None:
        attention.install(model, config, summary, keep)


def patch_summary(model: nn.Module) -> PatchSummary | None:
    """The summary of the patch of `model` itself (None when `model` is not a patched root; unlike
    `model.slimfit_summary`, a PeftModel does not forward this to the model it wraps)."""
    state = vars(model).get(MODEL_STATE)  # vars: PeftModel forwards unknown attributes to its base model
    return None if state is None else state["summary"]


def _release_patched(model: nn.Module, config: SlimFitConfig) -> dict:
    """Before (re-)patching: unpatch every patched model inside `model` (itself included) after
    checking it was patched with the same config; returns their NormCaches by module id."""
    # vars(), not getattr: PeftModel forwards unknown attributes to the model it wraps
    roots = [(name, module) for name, module in model.named_modules() if MODEL_STATE in vars(module)]
    for name, module in roots:
        if vars(module)[MODEL_STATE]["config"] != config:
            where = f"its submodule {name!r}" if name else "this model"
            raise RuntimeError(f"slimfit.patch: {where} is already patched with another config; call "
                               "slimfit.unpatch(model) first")
    if not roots and any(ORIGINAL_CLASS in vars(module) for module in model.modules()):
        raise RuntimeError("slimfit.patch: modules of this model are already patched, by slimfit.patch of a model "
                           "that contains it (or left patched by PEFT's merge_and_unload); call "
                           "slimfit.unpatch(model) first, or patch the containing model")
    caches = {id(module): vars(module)[NORM_CACHE] for module in model.modules() if NORM_CACHE in vars(module)}
    if roots:
        unpatch(model)
    return caches


def unpatch(model: nn.Module) -> nn.Module:
    """Restore every patched module's class, the attention implementation and the root hooks.

    Works from what is on the modules, not from the patched root's record: a model patched as a
    part of a larger one, or left by PEFT's merge_and_unload (patched modules, slimfit's attention
    in its config, no record) is restored as well."""
    found = False
    for module in model.modules():
        own = vars(module)  # not getattr: PeftModel forwards unknown attributes to the model it wraps
        root = MODEL_STATE in own
        if root:
            found = True
            remove_hooks(module)
            delattr(module, MODEL_STATE)
            vars(module).pop("slimfit_summary", None)
        original = own.get(ORIGINAL_CLASS)
        if original is not None:
            found = True
            module.__class__ = original
            delattr(module, ORIGINAL_CLASS)
            delattr(module, OPTIONS)
        if NORM_CACHE in own:
            found = True
            delattr(module, NORM_CACHE)
        found = attention.remove(module, root) or found
    unpatch_causal_lm(model)
    if not found:
        warnings.warn("slimfit.unpatch: the model is not patched; nothing to do", stacklevel=2)
    return model


__all__ = ["patch", "unpatch", "PatchSummary", "sample_ids", "norm_caches", "patch_summary"]
