"""The hooks slimfit.patch puts on the root of a patched model, and the record they read.

`MODEL_STATE` is the root's record of its patch (config, summary, the shared sample-id holder, the name
filters); the root's forward hooks read it at call time, so a deep copy of a patched model feeds its own
layers. The hooks: pop `sample_ids=` from the forward's keywords into the holder (sampling.py), advance
torch's generator once per forward (side seeds), and warn once when linear layers were added after the
patch (PEFT adapters). They are module-level functions carrying a mark, so a patched model pickles and
`remove_hooks` finds them without handles. `name_filter` is the target_modules / exclude_modules rule that
both the patch and the new-module check apply.
"""
from __future__ import annotations

import re
import warnings

import torch

from .modules import ORIGINAL_CLASS

MODEL_STATE = "_slimfit_state"


def name_filter(target_modules, exclude_modules):
    """keep(name) -> None when the module named `name` is selected, else the reason it is not."""
    target = _name_matcher("target_modules", target_modules)
    exclude = _name_matcher("exclude_modules", exclude_modules)

    def keep(name: str) -> str | None:
        prefixes = [name[:i] for i, char in enumerate(name) if char == "."] + [name]
        if target is not None and not any(target(prefix) for prefix in prefixes):
            return "not in target_modules"
        if exclude is not None and any(exclude(prefix) for prefix in prefixes):
            return "in exclude_modules"
        return None

    return keep


def _name_matcher(arg: str, spec):
    if spec is None:
        return None
    if isinstance(spec, str):
        try:
            pattern = re.compile(spec)
        except re.error as exc:
            raise ValueError(f"slimfit.patch: {arg}={spec!r} is not a valid regular expression ({exc})") from None
        return lambda name: pattern.fullmatch(name) is not None
    if isinstance(spec, (list, tuple, set, frozenset)) and all(isinstance(key, str) and key for key in spec):
        keys = tuple(spec)
        return lambda name: any(name == key or name.endswith("." + key) for key in keys)
    raise TypeError(f"slimfit.patch: {arg} must be a regular expression (str) or a list of module names, "
                    f"got {spec!r}")


def sample_id_holder(model: torch.nn.Module):
    """The SampleIds holder of a patched root (None: not patched, or patched without sampling)."""
    state = getattr(model, MODEL_STATE, None)
    return None if state is None else state.get("sample_ids")


_HOOK_MARK = "_slimfit_sample_ids_hook"  # marks every root hook slimfit.patch installs


def _pop_sample_ids(module, args, kwargs):
    holder = sample_id_holder(module)
    ids = kwargs.pop("sample_ids", None) if "sample_ids" in kwargs else None
    if holder is not None:
        holder.push(ids if ids is not None else holder.current)
    return args, kwargs


def _drop_sample_ids(module, args, kwargs, output):
    holder = sample_id_holder(module)
    if holder is not None:
        holder.pop()


def _advance_generator(module, args):
    """One draw from torch's generator per forward and a restart of the side-seed count, so side
    seeds (autograd/seeds.py: stochastic rounding, row draws) differ from step to step even when
    nothing else draws, and `torch.manual_seed` repeats them."""
    from ..autograd.seeds import reset_side_seeds

    torch.randint(0, 2, (1,))
    reset_side_seeds()


_ADDED_WARNING = (
    "slimfit: {n} linear layer(s) were added to this model after slimfit.patch and are not compressed "
    "(e.g. {names}; PEFT adapters?). Call slimfit.patch after get_peft_model, or call slimfit.patch(model, "
    "config) again on the outermost model: with the same config it re-patches everything."
)


def _check_new_modules(module, args):
    """Once, at the first forward: linear layers that slimfit.patch would have patched but that are
    not patched were added after it (PEFT's get_peft_model after slimfit.patch): say so."""
    state = getattr(module, MODEL_STATE, None)
    if state is None or state.get("checked") or torch.compiler.is_compiling():
        return
    state["checked"] = True
    keep = name_filter(*state.get("filters", (None, None)))
    added = [name for name, submodule in module.named_modules()
             if type(submodule) is torch.nn.Linear and not hasattr(submodule, ORIGINAL_CLASS) and not keep(name)]
    if added:
        warnings.warn(_ADDED_WARNING.format(n=len(added), names=", ".join(added[:3])), stacklevel=3)


def install_new_module_check(model: torch.nn.Module) -> None:
    model.register_forward_pre_hook(_check_new_modules)


# module-level functions (not closures) so that a patched model pickles
for _fn in (_pop_sample_ids, _drop_sample_ids, _advance_generator, _check_new_modules):
    setattr(_fn, _HOOK_MARK, True)


def install_sample_id_hooks(model: torch.nn.Module) -> None:
    """Root forward hooks: pop `sample_ids=` from the model's keyword arguments for this forward.
    The holder is looked up on the model at call time, so a deep copy of a patched model feeds its
    own layers."""
    model.register_forward_pre_hook(_pop_sample_ids, with_kwargs=True)
    model.register_forward_hook(_drop_sample_ids, with_kwargs=True, always_call=True)


def install_seed_hook(model: torch.nn.Module) -> None:
    """Root forward pre-hook advancing torch's generator once per forward (see _advance_generator)."""
    model.register_forward_pre_hook(_advance_generator)


def remove_hooks(model: torch.nn.Module) -> None:
    """Remove the root hooks slimfit.patch put on this model (found by their mark, not by handles: a
    deep copy's handles would point at the original's hook tables)."""
    for table in ("_forward_pre_hooks", "_forward_hooks"):
        hooks = getattr(model, table)
        for key in [hook_key for hook_key, hook in hooks.items() if getattr(hook, _HOOK_MARK, False)]:
            del hooks[key]
            for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                          "_forward_hooks_always_called"):
                getattr(model, extra, {}).pop(key, None)
