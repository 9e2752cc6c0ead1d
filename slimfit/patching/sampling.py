"""Sample ids for the WTA-CRS sampled linears of a patched model (docs/wta_crs.md).

A model patched with `SlimFitConfig.sampling` gets one `SampleIds` holder shared by all its sampled
linears. The ids of the current batch reach it in one of two ways:

    loss = model(**batch, sample_ids=batch_indices).loss        # popped by a root forward pre-hook
    with slimfit.patching.sample_ids(model, batch_indices):        # or a context manager
        loss = model(**batch).loss

One id per entry of the input's first dimension (the data loader's dataset indices). Without ids
the sampling probabilities are pᵢ ∝ ‖xᵢ‖ (a one-time warning says so); with them each layer's
`NormCache` supplies the stale gradient norms of the sample's rows from its previous visit.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

NORM_CACHE = "_slimfit_norm_cache"

_NO_IDS_WARNING = (
    "slimfit: sampling (SlimFitConfig.sampling) runs without sample ids, so rows are drawn with p ∝ ‖x‖ only "
    "(no stale gradient norms: the variance of plain CRS, often worse than uniform on padded text). Pass the "
    "batch's dataset indices: model(**batch, sample_ids=idx) or `with slimfit.patching.sample_ids(model, idx):`."
)


def _as_cpu_ids(ids):
    """Ids as given, but a tensor moved to the CPU as int64 once per forward (not once per layer)."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"slimfit: sample_ids must be integers, got dtype {ids.dtype}")
        return ids.detach().reshape(-1).to("cpu", torch.int64)
    return ids


class SampleIds:
    """The ids of the batch being run, shared by the sampled linears of one model."""

    def __init__(self):
        self._stack: list = []
        self._warned: set = set()

    @property
    def current(self):
        return self._stack[-1] if self._stack else None

    def push(self, ids) -> None:
        self._stack.append(None if ids is None else _as_cpu_ids(ids))

    def pop(self) -> None:
        if self._stack:
            self._stack.pop()

    def for_input(self, x: torch.Tensor, module_name: str):
        """The ids for a layer input x (None, with a one-time warning, when absent or not one per
        entry of x's first dimension)."""
        ids = self.current
        if ids is None:
            self.warn_once("no-ids", _NO_IDS_WARNING)
            return None
        n_ids = ids.numel() if isinstance(ids, torch.Tensor) else len(ids)
        batch = x.shape[0] if x.dim() >= 2 else 1
        if n_ids != batch:
            self.warn_once(("mismatch", module_name),
                           f"slimfit: {n_ids} sample ids for a batch of {batch} at {module_name} (input "
                           f"{tuple(x.shape)}); this layer samples without ids (p ∝ ‖x‖)")
            return None
        return ids

    def warn_once(self, key, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=4)


def _holder(model: torch.nn.Module) -> SampleIds | None:
    from . import MODEL_STATE

    state = getattr(model, MODEL_STATE, None)
    return None if state is None else state.get("sample_ids")


_HOOK_MARK = "_slimfit_sample_ids_hook"  # marks every root hook slimfit.patch installs


def _pop_sample_ids(module, args, kwargs):
    holder = _holder(module)
    ids = kwargs.pop("sample_ids", None) if "sample_ids" in kwargs else None
    if holder is not None:
        holder.push(ids if ids is not None else holder.current)
    return args, kwargs


def _drop_sample_ids(module, args, kwargs, output):
    holder = _holder(module)
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
    from . import MODEL_STATE, ORIGINAL_CLASS, _name_filter

    state = getattr(module, MODEL_STATE, None)
    if state is None or state.get("checked") or torch.compiler.is_compiling():
        return
    state["checked"] = True
    keep = _name_filter(*state.get("filters", (None, None)))
    added = [name for name, submodule in module.named_modules()
             if type(submodule) is torch.nn.Linear and not hasattr(submodule, ORIGINAL_CLASS) and not keep(name)]
    if added:
        warnings.warn(_ADDED_WARNING.format(n=len(added), names=", ".join(added[:3])), stacklevel=3)


def install_new_module_check(model: torch.nn.Module) -> None:
    model.register_forward_pre_hook(_check_new_modules)


# module-level functions (not closures) so that a patched model pickles
for _fn in (_pop_sample_ids, _drop_sample_ids, _advance_generator, _check_new_modules):
    setattr(_fn, _HOOK_MARK, True)


def install_hooks(model: torch.nn.Module) -> None:
    """Root forward hooks: pop `sample_ids=` from the model's keyword arguments for this forward.
    The holder is looked up on the model at call time, so a deep copy of a patched model feeds its
    own layers."""
    model.register_forward_pre_hook(_pop_sample_ids, with_kwargs=True)
    model.register_forward_hook(_drop_sample_ids, with_kwargs=True, always_call=True)


def install_seed_hook(model: torch.nn.Module) -> None:
    """Root forward pre-hook advancing torch's generator once per forward (see _advance_generator)."""
    model.register_forward_pre_hook(_advance_generator)


def remove_hooks(model: torch.nn.Module) -> None:
    """Remove the hooks `install_hooks` put on this model (found by their mark, not by handles: a
    deep copy's handles would point at the original's hook tables)."""
    for table in ("_forward_pre_hooks", "_forward_hooks"):
        hooks = getattr(model, table)
        for key in [hook_key for hook_key, hook in hooks.items() if getattr(hook, _HOOK_MARK, False)]:
            del hooks[key]
            for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                          "_forward_hooks_always_called"):
                getattr(model, extra, {}).pop(key, None)


@contextlib.contextmanager
def sample_ids(model: torch.nn.Module, ids):
    """Run the forward passes inside the block with these sample ids (one per entry of the batch)."""
    from . import MODEL_STATE

    if getattr(model, MODEL_STATE, None) is None:
        raise RuntimeError("slimfit.patching.sample_ids: the model is not patched (call slimfit.patch first)")
    holder = _holder(model)
    if holder is None:  # patched without sampling: nothing reads ids
        yield
        return
    holder.push(ids)
    try:
        yield
    finally:
        holder.pop()


def norm_caches(model: torch.nn.Module) -> dict:
    """{module name: NormCache} of the sampled linears (for checkpoints: `cache.state_dict()`)."""
    return {name: getattr(module, NORM_CACHE) for name, module in model.named_modules() if hasattr(module, NORM_CACHE)}
