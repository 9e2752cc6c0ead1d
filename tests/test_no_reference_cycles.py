"""A patched model, its optimizer and its scheduler are freed by reference counting alone.

On a GPU, memory held by objects in a reference cycle stays taken after `del` until Python's cyclic GC
happens to run: a second model built in the same process (a sweep, a benchmark, a notebook) then finds
the first one's weights and AdamW state still on the device. Two such cycles were found on an H200 (the
chunked LM loss bound to its module; the optimizer's step hooks bound to the scheduler's guard).
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from patching.tiny_models import build

import slimfit
from slimfit import SlimFitConfig
from slimfit.scheduler import ILSScheduler

pytest.importorskip("transformers")


def _train_and_drop(family: str, preset: str, scheduled: bool) -> list[weakref.ref]:
    model, inputs = build(family)[:2]
    slimfit.patch(model, SlimFitConfig.preset(preset))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = ILSScheduler(model, seed=0) if scheduled else None
    if scheduler is not None:
        scheduler.attach_optimizer(optimizer)
    for _ in range(2):
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
    return [weakref.ref(obj) for obj in (model, optimizer, scheduler) if obj is not None]


@pytest.mark.parametrize("family", ["bert", "llama"])
@pytest.mark.parametrize("scheduled", [False, True], ids=["patched", "scheduled"])
def test_model_optimizer_and_scheduler_freed_without_the_cyclic_gc(family, scheduled):
    _train_and_drop(family, "paper", scheduled)  # first-use caches of torch and transformers
    gc.collect()
    gc.disable()
    try:
        refs = _train_and_drop(family, "paper", scheduled)
        alive = [type(ref()).__name__ for ref in refs if ref() is not None]
    finally:
        gc.enable()
    assert not alive, f"kept alive by a reference cycle after the last reference went: {alive}"
