"""The spec's whole training step run on fake tensors under slimfit.memory.measure_step's tracker: the
prediction's engine (predict.py is the entry point, which first computes the scheduler's budget).

    p = predict_step(spec, budget=None)     # a Prediction: p.total, p.parts(), p.peak_phase

Why fake tensors rather than fitting small measured runs: the peak of a step is a maximum over time of
a sum of storages, whose composition changes with the configuration (the optimizer step's peak for a
small batch, backward's for a long sequence, checkpointing's recomputation, slimfit's compressed saves,
a frozen set that is not the same share of every layer). Extrapolating it from small sizes needs a model
of each of those; running the step itself at full size on fake tensors needs none, costs no memory and
counts every storage as the CPU measurement does (the same tracker, the same ops, the same order).

The scheduler's step (after the optimizer's) runs on fake tensors too while the trained layers are small
(SCHEDULER_RUN_NUMEL: its CPU scoring walks the weights in blocks of 32K elements, a dozen ops each, which
for a large model is most of the prediction's time); above that it is not run: its weight snapshots are
taken by the optimizer's step pre-hook in the step itself (with an optimizer attached; without one they
are stand-ins of the same size, live from the step's start), and its own temporaries are a few blocks
(under 1 MiB), far below the gradients and AdamW temporaries of the optimizer step before it, so it
cannot hold the peak there.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

from .. import peak
from ..models import CAUSAL_LM, ModelRef, resolve_model
from .cost import CostCounter
from .fake import PlanMode, cuda_attention_backends, masks_read_as_data, new_fake_mode
from .spec import StepSpec
from .step import Step, open_step

__all__ = ["Prediction", "predict_step", "SCHEDULER_RUN_NUMEL"]

SCHEDULER_RUN_NUMEL = 1 << 21


@dataclasses.dataclass
class Prediction:
    """The predicted step peak (bytes) with its parts at the peak, counts of the step and its cost."""

    spec: StepSpec
    memory: peak.StepMemory
    params: int = 0
    optimized: int = 0
    trained: int = 0
    layers: int = 0
    frozen_layers: int = 0
    warmup_steps: int = 0       # the scheduler's ramp (resolved warmup_steps): this first step is its start
    causal_lm: bool = False     # the model is a causal LM (the scheduler's default ramps its rate)
    flops: float = 0.0          # floating-point operations of the step (matmuls, attention, convolutions)
    bytes_moved: float = 0.0    # bytes read and written by its ops
    ops: int = 0
    checks_answered: int = 0    # boolean reads of fake data in the step answered True (fake.PlanMode)
    seconds: float = 0.0        # how long the prediction took
    model_name: str = ""
    lora_targets: tuple = ()    # LoRA's target modules and fully trained modules (for the code to paste)
    lora_heads: tuple = ()

    @property
    def total(self) -> int:
        """The predicted step peak in bytes."""
        return self.memory.total

    @property
    def peak_phase(self) -> str:
        """Where the predicted peak is: forward, backward, optimizer, zero_grad or after_step."""
        return self.memory.peak_phase

    def parts(self) -> dict[str, int]:
        """The parts of the predicted peak (weights, gradients, optimizer_state, saved, transient)."""
        return self.memory.parts()

    def step_time(self, device: str | None = None) -> float:
        """Estimated seconds of one step on the device (cost.py's model)."""
        from .cost import step_seconds

        return step_seconds(self.flops, self.bytes_moved, self.ops, device or self.spec.device,
                            self.spec.matmul_dtype)


def _after_step(step: Step, mode: PlanMode):
    """The scheduler's step, numbers read from fake data answered; for large trained layers its snapshots
    only (stand-ins read once, so the tracker counts them as live from the step's start)."""
    import torch

    if step.scheduler is None:
        return None
    params = dict(step.model.named_parameters())
    trained = [params[n] for n in step.scheduler.trained_names() if n in params]
    if sum(p.numel() for p in trained) <= SCHEDULER_RUN_NUMEL:
        def run():
            """The scheduler's step with numeric reads of fake data answered (its scores)."""
            mode.numbers = True
            step.after_step()
        return run
    if step.scheduler.snapshots_on_update:
        # its snapshots are taken in the optimizer's step pre-hook (fake clones the tracker counts from
        # there); its step, which drops them, runs after the peak
        return None
    snapshots = [torch.empty_like(p, requires_grad=False) for p in trained]

    def touch():
        """Read each snapshot stand-in once, so the tracker counts it as live from the step's start."""
        for t in snapshots:
            torch.ops.aten.alias.default(t)
    return touch


@contextlib.contextmanager
def _numbers_in_optimizer_steps(mode: PlanMode):
    """Numbers read from fake data answered inside every optimizer step (0), as in the scheduler's step: the
    scheduler scores its trained layers inside a chunked optimizer step (slimfit/scheduler/in_step.py).
    Global hooks: the optimizer's own hooks (the chunked step's among them) come after them; also for the
    per-parameter optimizers of a step in backward."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def on(optimizer, args, kwargs):
        mode.numbers = True

    def off(optimizer, args, kwargs):
        mode.numbers = False

    handles = [register_optimizer_step_pre_hook(on), register_optimizer_step_post_hook(off)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def predict_step(spec: StepSpec, ref: ModelRef | None = None, freeze_all: bool = False,
                 budget: dict | None = None) -> Prediction:
    """Predict the whole step's peak memory of `spec` without allocating it (fake tensors). freeze_all: with
    every layer the scheduler would schedule frozen (the base of a budget, budget.py); budget: the scheduler's
    budget-mode arguments when the spec has budget_bytes (open_step's)."""
    import torch

    start = time.perf_counter()
    ref = ref or resolve_model(spec.model, spec.task)
    fake = new_fake_mode()
    cost = CostCounter()
    # the caller's random state is left as it was (the build and the step are seeded)
    opened = open_step(spec, fake=fake, ref=ref, freeze_all=freeze_all, budget=budget)
    with torch.random.fork_rng(devices=[]), opened as step:
        torch.manual_seed(spec.seed)
        backends = cuda_attention_backends() if spec.device == "cuda" else contextlib.nullcontext()
        with fake, backends, masks_read_as_data(), PlanMode(numbers=False, on_op=cost.add) as mode, \
                _numbers_in_optimizer_steps(mode):
            after = _after_step(step, mode)
            cost.active = True
            memory = peak.measure_step(step.model, step.forward, step.optimizer, after_step=after,
                                       name=spec.label())
        counts = dict(params=step.params, optimized=step.optimized, trained=step.trained, layers=step.layers,
                      frozen_layers=step.frozen_layers, warmup_steps=step.warmup_steps,
                      causal_lm=step.ref.task == CAUSAL_LM,
                      checks_answered=mode.answered,
                      lora_targets=step.lora_targets, lora_heads=step.lora_heads)
    memory.method = "predicted: fake tensors under the CPU storage tracker"
    return Prediction(spec, memory, flops=cost.flops, bytes_moved=cost.bytes, ops=cost.ops,
                      seconds=time.perf_counter() - start, model_name=ref.name, **counts)
