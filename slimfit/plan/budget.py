"""Bytes for ILSScheduler's budget mode, from the planner: the scheduler keeps
base_bytes + sum(bytes of the trained layers) <= budget_bytes at every step (slimfit/scheduler/budget.py).

    budget = scheduler_budget(StepSpec("bert-base", batch=8, seq=256, preset="paper", rate=0.7), 20 * 2**30)
    scheduler = ILSScheduler(model, freeze_rate=0.7, optimizer=optimizer, **budget)

base_bytes: the predicted step peak with every scheduled layer frozen (fake tensors, slimfit.plan.predict).
A layer's bytes: what training it can add to the peak, each counted whole although they peak at different
times: its gradient, the scheduler's snapshot of its weight, and its input at full precision (what a
plain linear saves for the weight gradient; slimfit's presets save it compressed, and Q/K/V share one
input, so this overstates). Each term bounds the layer's share from above, so base + the sum bounds the
peak of any trained set: the budget holds for the frozen sets of later steps too, not only the first.
The scheduler needed no change: its activation_bytes / base_bytes / budget_bytes take these numbers as
they are (its docstring's "activation bytes" are, here, all the bytes a trained layer costs).
"""
from __future__ import annotations

from .models import ModelRef, resolve_model
from .spec import StepSpec

__all__ = ["layer_bytes", "scheduler_budget"]


def layer_bytes(spec: StepSpec, ref: ModelRef | None = None) -> dict[str, int]:
    """{scheduled layer name: gradient + snapshot + full-precision input bytes} for the spec's model and batch
    (computed on fake tensors)."""
    import torch

    from ..scheduler import estimate_activation_bytes
    from .fake import PlanMode, new_fake_mode
    from .step import open_step

    ref = ref or resolve_model(spec.model, spec.task)
    fake = new_fake_mode()
    with open_step(spec, fake=fake, ref=ref, freeze_all=True) as step:
        params = dict(step.model.named_parameters())
        with fake, PlanMode(numbers=False), torch.no_grad():
            inputs = estimate_activation_bytes(step.model, **step.inputs)
        return {n: 2 * params[n].numel() * params[n].element_size() + int(inputs.get(n, 0))
                for n in step.scheduled}


def scheduler_budget(spec: StepSpec, budget_bytes: float, ref: ModelRef | None = None) -> dict:
    """The keyword arguments of ILSScheduler's budget mode for the spec's step under `budget_bytes`:
    budget_bytes, activation_bytes (per layer, layer_bytes) and base_bytes (the all-frozen peak)."""
    from .predict import predict

    if not spec.rate:
        raise ValueError("scheduler_budget: the spec has no freeze rate, so no scheduler to give a budget")
    ref = ref or resolve_model(spec.model, spec.task)
    base = predict(spec.replace(budget_bytes=None), ref=ref, freeze_all=True).total
    return {"budget_bytes": float(budget_bytes), "activation_bytes": layer_bytes(spec, ref), "base_bytes": float(base)}
