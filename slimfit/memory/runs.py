"""One reference step made and measured: the scheduler's first frozen set, autocast, a primed AdamW, and
the two measurements of slimfit.memory run on a reference model with its dropout seeded. `slimfit memory`
(slimfit/memory/cli.py), the plan's step (slimfit/memory/plan/step.py) and the scripts of bench/ share them.

    from slimfit.memory import models, runs
    model = models.build("bert-base"); inputs = models.make_inputs(model, models.TEXT_CLS, batch=2)
    frozen, candidates = runs.scheduler_frozen_set(model, 0.9)   # ILSScheduler's first frozen set
    runs.set_frozen(model, frozen)
    saved = runs.saved_of_step(model, inputs)    # slimfit.memory.measure of one forward + backward: SavedMemory
    peak = runs.peak_of_step(model, inputs)      # slimfit.memory.measure_step of one whole step (AdamW): StepMemory
"""
from __future__ import annotations

import contextlib
import re

__all__ = ["scheduler_frozen_set", "set_frozen", "autocast_context", "saved_of_step", "adamw", "prime_optimizer",
           "peak_of_step", "collapse_layers", "collapse_layers_name"]


def scheduler_frozen_set(model, freeze_rate: float, seed: int = 0) -> tuple[list[str], list[str]]:
    """(frozen, candidates): the layers ILSScheduler(model, freeze_rate, seed=seed) freezes at its
    first step at the rate (a seeded random share: no layer has a score yet; no ramp: a causal LM's default
    warmup_steps would freeze nothing yet). Leaves every parameter trainable."""
    from ..scheduler import ILSScheduler

    set_frozen(model, ())  # candidates are the parameters that require grad
    sched = ILSScheduler(model, freeze_rate=freeze_rate, seed=seed, warmup_steps=0)
    frozen, candidates = sched.frozen_names(), list(sched.names)
    del sched
    set_frozen(model, ())
    return frozen, candidates


def set_frozen(model, names) -> None:
    """Freeze exactly the parameters named in `names`; every other parameter trains."""
    names = set(names)
    for n, p in model.named_parameters():
        p.requires_grad_(n not in names)
        if n in names:
            p.grad = None


def autocast_context(dtype: str, device="cpu"):
    """The autocast of a measured step: none for "fp32", bf16 autocast for "bf16" (the memory command's
    meaning) and "bf16-autocast" (StepSpec's name for it)."""
    import torch

    if dtype == "fp32":
        return contextlib.nullcontext()
    if dtype in ("bf16", "bf16-autocast"):
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    raise ValueError(f"dtype must be fp32, bf16 or bf16-autocast, got {dtype!r}")


def saved_of_step(model, inputs: dict, *, dtype: str = "fp32", seed: int = 0, name: str = ""):
    """slimfit.memory.measure of one forward + backward (dropout seeded); grads dropped after."""
    import torch

    from .saved import measure

    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    with autocast_context(dtype, device):
        result = measure(model, **inputs)
    model.zero_grad(set_to_none=True)
    result.name = name
    return result


def adamw(model, lr: float = 0.0, every_parameter: bool = False):
    """AdamW over the parameters that require grad, or over every parameter (`every_parameter`: a model
    trained under the scheduler, whose frozen layers keep their optimizer state). lr=0 by default: a
    measured step does all of AdamW's work (moments, temporaries) and leaves the weights as they were."""
    import torch

    return torch.optim.AdamW([p for p in model.parameters() if every_parameter or p.requires_grad], lr=lr)


def prime_optimizer(optimizer) -> None:
    """Create the optimizer's lazy state (AdamW's moments) without a forward or backward: one step on zero
    gradients for the parameters that have no state yet, then the gradients dropped. A step measured after
    this finds the state resident, as every step after the first does; that includes the parameters frozen
    now: under a scheduler every layer has trained at some step, and the optimizer keeps its state."""
    import torch

    params = [p for g in optimizer.param_groups for p in g["params"]
              if p.grad is None and not optimizer.state.get(p)]
    if not params:
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    # the step without the optimizer's own hooks: the scheduler's guard drops the gradients of frozen layers
    # before a step, and those layers' state is what is being made here
    hooks = [getattr(optimizer, name, None) for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")]
    saved = [dict(h) if h is not None else None for h in hooks]
    for h in hooks:
        if h is not None:
            h.clear()
    try:
        optimizer.step()
    finally:
        for h, kept in zip(hooks, saved):
            if h is not None:
                h.update(kept)
    for p in params:
        p.grad = None


def peak_of_step(model, inputs: dict, *, dtype: str = "fp32", optimizer=None, seed: int = 0,
                      extra: dict | None = None, after_step=None, prime: bool = True, name: str = "",
                      scheduled: bool = False):
    """slimfit.memory.measure_step of one whole training step: forward (autocast for bf16, dropout
    seeded), backward, optimizer step, zero_grad (+ after_step). The optimizer defaults to `adamw(model)`
    (lr 0; `scheduled`: over every parameter, as under the scheduler, whose frozen layers keep their state),
    primed so that its state is resident as in any step after the first (prime=False: the first step, state
    created inside it). Returns a StepMemory."""
    import torch

    from .peak import measure_step

    optimizer = adamw(model, every_parameter=scheduled) if optimizer is None else optimizer
    if prime:
        prime_optimizer(optimizer)
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    batch = {**inputs, **(extra or {})}

    def forward():
        with autocast_context(dtype, device):
            return model(**batch)

    torch.manual_seed(seed)
    return measure_step(model, forward, optimizer, after_step=after_step, name=name)


_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")


def collapse_layers_name(path: str) -> str:
    """`bert.encoder.layer.3.output.dense` -> `bert.encoder.layer.*.output.dense`."""
    return _LAYER_INDEX.sub(".*", path)


def collapse_layers(run):
    """A copy of a SavedMemory with the layer indices of module paths replaced by '*'
    (`bert.encoder.layer.*.attention.self`): one row per role, same total."""
    from .saved import SavedMemory

    out = SavedMemory(total=run.total, excluded=run.excluded, name=run.name)
    for path, nbytes in run.per_module.items():
        key = collapse_layers_name(path)
        out.per_module[key] = out.per_module.get(key, 0) + nbytes
        out.counts[key] = out.counts.get(key, 0) + run.counts.get(path, 0)
    return out
