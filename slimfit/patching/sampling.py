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

from .modules import NORM_CACHE
from .root_hooks import MODEL_STATE, sample_id_holder

__all__ = ["NORM_CACHE", "SampleIds", "sample_ids", "norm_caches"]

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


@contextlib.contextmanager
def sample_ids(model: torch.nn.Module, ids):
    """Run the forward passes inside the block with these sample ids (one per entry of the batch)."""
    if getattr(model, MODEL_STATE, None) is None:
        raise RuntimeError("slimfit.patching.sample_ids: the model is not patched (call slimfit.patch first)")
    holder = sample_id_holder(model)
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
