"""Bytes for ILSScheduler's budget mode, from the planner: the scheduler keeps
base_bytes + sum(bytes of the trained layers) <= budget_bytes at every step (slimfit/scheduler/budget.py).

    budget = scheduler_budget(StepSpec("bert-base", batch=8, seq=256, preset="paper", rate=0.7), 20 * 2**30)
    scheduler = ILSScheduler(model, freeze_rate=0.7, optimizer=optimizer, **budget)

base_bytes: the predicted step peak with every scheduled layer frozen (fake tensors, fakerun.py),
their optimizer state held as the scheduler holds a frozen layer's (its frozen_state: 8-bit by default).
A layer's bytes: what training it can add to the peak, each counted whole although they peak at different
times: its gradient, the scheduler's snapshot of its weight, its input at full precision (what a
plain linear saves for the weight gradient; slimfit's presets save it compressed, and Q/K/V share one
input, so this overstates), and what its optimizer state grows by when it is back in full. Each term
bounds the layer's share from above, so base + the sum bounds the peak of any trained set: the budget holds
for the frozen sets of later steps too, not only the first (rate_bound: the same at a freeze rate).
The scheduler needed no change: its activation_bytes / base_bytes / budget_bytes take these numbers as
they are (its docstring's "activation bytes" are, here, all the bytes a trained layer costs).
"""
from __future__ import annotations

import math

from ..models import ModelRef, resolve_model
from .fakerun import predict_step
from .spec import StepSpec
from .step import open_step

__all__ = ["layer_bytes", "scheduler_budget", "rate_bound"]


def _held_growth(optimizer, p) -> int:
    """Bytes the optimizer state of ``p`` grows by on its device when it comes back in full from 8-bit or from
    host memory elsewhere (the base step holds every scheduled layer's state as the scheduler's frozen_state
    does; a trained layer has it in full); 0 when none is held (or the host copy is on the same device)."""
    import torch

    from ...optim.codec import code_of, encoded_nbytes
    from ...optim.keys import held_key

    grow = 0
    for key, value in (optimizer.state.get(p) or {}).items():
        if held_key(key) and isinstance(value, dict):
            numel = math.prod(value["shape"])
            grow += numel * value["dtype"].itemsize - encoded_nbytes(numel, int(value["group_size"]), **code_of(value))
        elif held_key(key) and isinstance(value, torch.Tensor) and value.device != p.device:
            grow += value.numel() * value.element_size()   # offloaded: the device gets it all back
    return grow


def layer_bytes(spec: StepSpec, ref: ModelRef | None = None) -> dict[str, int]:
    """{scheduled layer name: gradient + snapshot + full-precision input bytes + what its held optimizer state
    grows by in full} for the spec's model and batch (computed on fake tensors)."""
    import torch

    from ...scheduler import estimate_activation_bytes
    from .fake import PlanMode, new_fake_mode

    ref = ref or resolve_model(spec.model, spec.task)
    fake = new_fake_mode()
    with open_step(spec, fake=fake, ref=ref, freeze_all=True) as step:
        params = dict(step.model.named_parameters())
        with fake, PlanMode(numbers=False), torch.no_grad():
            inputs = estimate_activation_bytes(step.model, **step.inputs)
        return {n: 2 * params[n].numel() * params[n].element_size() + int(inputs.get(n, 0))
                + _held_growth(step.optimizer, params[n]) for n in step.scheduled}


def scheduler_budget(spec: StepSpec, budget_bytes: float, ref: ModelRef | None = None) -> dict:
    """The keyword arguments of ILSScheduler's budget mode for the spec's step under `budget_bytes`:
    budget_bytes, activation_bytes (per layer, layer_bytes) and base_bytes (the all-frozen peak)."""
    if not spec.rate:
        raise ValueError("scheduler_budget: the spec has no freeze rate, so no scheduler to give a budget")
    ref = ref or resolve_model(spec.model, spec.task)
    base = predict_step(spec.replace(budget_bytes=None), ref=ref, freeze_all=True).total
    return {"budget_bytes": float(budget_bytes), "activation_bytes": layer_bytes(spec, ref), "base_bytes": float(base)}


def rate_bound(spec: StepSpec, ref: ModelRef | None = None) -> int:
    """An upper bound on the step peak of any frozen set the scheduler can choose at the spec's rate (a rate
    step's peak moves with its trained set; predict gives the first set's): the all-frozen
    peak plus the bytes of the largest layers, as many as train in a step (the same per-layer bounds as the
    budget mode's). Under budget mode (budget_bytes), the budget itself bounds every step."""
    from ...scheduler.selection import num_frozen

    if not spec.rate:
        raise ValueError("rate_bound: the spec has no freeze rate, so every step trains the same layers")
    ref = ref or resolve_model(spec.model, spec.task)
    base = predict_step(spec.replace(budget_bytes=None), ref=ref, freeze_all=True).total
    per_layer = sorted(layer_bytes(spec, ref).values(), reverse=True)
    trained = len(per_layer) - num_frozen(spec.rate, len(per_layer))
    return base + sum(per_layer[:trained])
