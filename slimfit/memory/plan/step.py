"""The training step a plan is about, built one way for both the prediction and the measurement.

    with open_step(spec) as step:               # real tensors: predict.py's measure, bench/plan_accuracy.py
        run = measure_step(step.model, step.forward, step.optimizer, after_step=step.after_step)
    with fake_mode, open_step(spec, fake=fake_mode) as step: ...   # fake tensors: fakerun.py
    with open_step(spec, budget=scheduler_budget(...)) as step: ... # the scheduler's budget mode (budget.py)

The step is the one of a run in its steady state, as a user writes it:
  1. the model from its config (random weights), train mode, dropout on; gradient checkpointing of every
     layer if asked (use_reentrant=False); LoRA through peft (its default target modules for the family,
     the task head trained in full) if asked; then slimfit.patch with the preset;
  2. AdamW over the parameters that ever train (every parameter with a scheduler: each layer trains some
     steps, so each has its moments; the adapters with LoRA), lr 0 (the weights stay as they are; the step
     does all of AdamW's work), foreach on CUDA as torch picks there; its state made beforehand, as in every
     step after the first;
  3. with a freeze rate, ILSScheduler(model, freeze_rate=rate, seed=seed, warmup_steps=spec.warmup_steps)
     attached to the optimizer: its first frozen set is applied (the run's worst step: under a rate ramp,
     a causal LM's default, nothing is frozen yet; the frozen layers' moments held as the spec's
     optimizer_state says), its weight snapshots of the trained layers are live, and its step() runs after the
     optimizer's (scores, next frozen set).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from .. import runs
from ..models import CAUSAL_LM, IMAGE_CLS, ModelRef, build_model, make_batch, resolve_model
from .spec import StepSpec

__all__ = ["Step", "open_step", "run_step", "lora_targets", "check_spec"]

LORA_FALLBACK_TARGETS = ("query", "value", "q_proj", "v_proj", "q_lin", "v_lin")
CHUNKED_LOSS_ROWS = 256   # rows a chunk of StepSpec.chunked_loss: paper()'s lm_head_chunk_rows


@dataclasses.dataclass
class Step:
    """A built step: call `forward()` for the output (autocast inside), then the loss's backward, the
    optimizer's step, zero_grad and `after_step()`; slimfit.memory.measure_step does exactly that."""

    spec: StepSpec
    ref: ModelRef
    model: Any
    inputs: dict
    optimizer: Any
    scheduler: Any = None
    params: int = 0             # parameters of the model (LoRA adapters included)
    optimized: int = 0          # parameters the optimizer holds state for
    trained: int = 0            # parameters that get a gradient this step
    frozen_layers: int = 0      # scheduled layers frozen this step
    warmup_steps: int = 0       # the scheduler's rate ramp in steps (resolved): this step is its first
    layers: int = 0             # scheduled layers
    lora_targets: tuple = ()    # LoRA: the target modules and the modules trained in full (the task head)
    lora_heads: tuple = ()
    scheduled: tuple = ()       # names of the layers the scheduler schedules
    run_device: str = "cpu"     # where the tensors are: the spec's device, or the CPU for a fake run

    def forward(self):
        """The model's output on the batch, under bf16 autocast when the spec asks for it (bf16-autocast)."""
        with runs.autocast_context("bf16" if self.spec.autocast else "fp32", self.run_device):
            return self.model(**self.inputs)

    def after_step(self) -> None:
        """The scheduler's step (scores, next frozen set), as a training loop calls it after optimizer.step()."""
        if self.scheduler is not None:
            self.scheduler.step()


def check_spec(spec: StepSpec, ref: ModelRef, fake: bool = False) -> None:
    """ValueError for a spec the model cannot run (a text model without seq, an image size with text...).
    fake: a prediction, which runs torchao's 8-bit AdamW as its stand-in (optim8bit.py): torchao not needed."""
    if ref.task == IMAGE_CLS:
        if spec.seq is not None:
            raise ValueError(f"{ref.name} is a vision model: give image_size (pixels), not seq")
    elif spec.seq is None:
        raise ValueError(f"{ref.name} is a text model: give seq (tokens per sequence)")
    elif spec.image_size is not None:
        raise ValueError(f"{ref.name} is a text model: image_size applies to vision models")
    if spec.chunked_loss and ref.task != CAUSAL_LM:
        raise ValueError(f"chunked_loss chunks a causal LM's loss; {ref.name} is a {ref.task} model")
    if spec.optimizer == "adamw8bit-bnb" and spec.device != "cuda":
        raise ValueError("optimizer adamw8bit-bnb is planned for device cuda only: bitsandbytes' CUDA step is one "
                         "fused kernel that allocates nothing, but its CPU step decodes each parameter's moments in "
                         "full and works on fp32 copies of the parameter and its gradient, which the plan does not "
                         "model; give device cuda, or optimizer adamw8bit (torchao's) for a CPU plan")
    if spec.optimizer == "adamw8bit" and not fake:
        from .optim8bit import available

        if not available():
            raise ValueError("optimizer adamw8bit needs torchao (torchao.optim.AdamW8bit), which is not installed")


def lora_targets(model, ref: ModelRef) -> list[str]:
    """peft's default LoRA targets for the model type, else the attention query/value projections found."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

    targets = defaults.get(ref.model_type)
    if targets:
        return list(targets)
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    found = [t for t in LORA_FALLBACK_TARGETS if t in leaves]
    if not found:
        raise ValueError(f"no LoRA target modules known for model type {ref.model_type!r}")
    return found


def lora_heads(model, ref: ModelRef) -> list[str]:
    """The modules a LoRA run trains in full: a classifier's fresh head (none for a causal LM)."""
    from ...scheduler.candidates import find_task_heads

    return list(find_task_heads(model)) if ref.task != CAUSAL_LM else []


def _add_lora(model, ref: ModelRef, rank: int):
    """The model wrapped by peft's LoRA at `rank` (alpha 2 * rank): the targets of lora_targets, the head of
    lora_heads trained in full."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=lora_targets(model, ref),
                        modules_to_save=lora_heads(model, ref) or None)
    return get_peft_model(model, config)


def _build(spec: StepSpec, ref: ModelRef, fake=None, mesh=None):
    """The model of the spec: checkpointing, LoRA and the preset applied, on its device, sharded over ``mesh``
    (world_size > 1: sharding.py). fake: the FakeTensorMode of a prediction (every parameter fake, the small
    ones made for real too: fake.fake_parameters)."""
    import slimfit
    from slimfit.config import SlimFitConfig

    model = build_model(ref, attn=spec.attn, layers=spec.layers, image_size=spec.image_size, seed=spec.seed,
                        init=fake is None, dtype=spec.weight_dtype)
    if fake is not None:
        from .fake import fake_parameters

        fake_parameters(model, fake)
    if spec.checkpointing:
        model.config.use_cache = False
        if hasattr(model, "activation_checkpointing_enable"):  # the transformers >= 5 name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec.lora:
        model = _add_lora(model, ref, spec.lora)
    if spec.preset != "none":
        slimfit.patch(model, SlimFitConfig.preset(spec.preset))
    elif spec.chunked_loss:   # the chunked loss alone (the presets chunk it already): nothing else compressed
        slimfit.patch(model, SlimFitConfig(dropout="torch", lm_head_chunk_rows=CHUNKED_LOSS_ROWS))
    if mesh is not None:
        from .sharding import shard

        shard(model, mesh, spec.device)
    return model if spec.device == "cpu" or fake is not None else model.to(spec.device)


def _optimizer(spec: StepSpec, model, fake: bool = False):
    """AdamW (lr 0) over the parameters that ever train, state made beforehand (8-bit: torchao's, or its
    stand-in in a fake run; bitsandbytes' or its stand-in, optim8bit.py); one per parameter, stepped inside
    backward, with step_in_backward."""
    import torch

    held = _held_by_scheduler(spec, model)
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in held]
    if spec.optimizer == "adamw8bit":
        from .optim8bit import FakeAdamW8bit, optimizer_class

        cls, options = (FakeAdamW8bit if fake else optimizer_class()), {"lr": 0.0}
    elif spec.optimizer == "adamw8bit-bnb":   # device cuda only (check_spec)
        from .optim8bit import FakeBnbAdamW8bit, bnb_optimizer_class

        cls, options = (FakeBnbAdamW8bit if fake else bnb_optimizer_class()), {"lr": 0.0}
    else:
        cls, options = torch.optim.AdamW, {"lr": 0.0, "foreach": spec.device == "cuda"}
    if spec.step_in_backward:
        from ...optim import step_in_backward

        optimizer = step_in_backward(params, cls, **options)
    else:
        optimizer = cls(params, **options)
    runs.prime_optimizer(optimizer)
    return optimizer


def _new_scheduler(spec: StepSpec, model, freeze_all: bool, **options):
    """ILSScheduler(model, spec's rate and seed, **options); None for a base without layers (search.py's shallow
    estimates, freeze_all) whose one weight matrix is the held table (a tied LM head): nothing to schedule, the
    table frozen as the scheduler would hold it."""
    from ...scheduler import ILSScheduler

    try:
        return ILSScheduler(model, freeze_rate=spec.rate, seed=spec.seed, **options)
    except ValueError:
        never = _held_by_scheduler(spec, model)
        if not (freeze_all and never):
            raise
        for p in model.parameters():
            p.requires_grad_(p.requires_grad and id(p) not in never)
        return None


def _held_by_scheduler(spec: StepSpec, model) -> set:
    """ids of the parameters the spec's scheduler holds frozen for the whole run (its embeddings="freeze": the
    input embedding table), which never get optimizer state: left out of the primed optimizer."""
    if not spec.rate:
        return set()
    from ...scheduler.candidates import find_candidates
    from ...scheduler.embeddings import held_embeddings

    if spec.embeddings != "freeze":
        return set()
    return {id(p) for _, p in held_embeddings(model, find_candidates(model))}


def _scheduler(spec: StepSpec, model, optimizer, budget: dict | None, freeze_all: bool = False, fake: bool = False):
    """(ILSScheduler at the spec's rate, attached, its first frozen set applied, or None without a rate; the
    names of the layers it schedules). budget: the keyword arguments of the scheduler's budget mode (the
    caller's budget.scheduler_budget). freeze_all: no scheduler; every layer it would schedule is frozen (the
    base of a budget)."""
    if not spec.rate:
        return None, ()
    from ..._optimizer_state import HOLDERS, auto_step_chunk_numel, from_frozen_state

    options = {} if freeze_all else dict(budget or {})
    if spec.scheduled_kinds is not None:
        options["scheduled_kinds"] = spec.scheduled_kinds
    if spec.state_code is not None:
        options["state_code"] = spec.state_code
    options["embeddings"] = spec.embeddings
    mode = spec.held_state
    held, between_steps = HOLDERS.get(from_frozen_state(mode), (None, False))
    # a fake CPU run of a CUDA step: the offloaded state must leave the counted device, as it leaves the GPU
    off_device = fake and held == "offload" and spec.device == "cuda"
    # the chunk "auto" gives the spec's device (a fake run's tensors are on the CPU whatever the device)
    numel = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    scheduler = _new_scheduler(spec, model, freeze_all, warmup_steps=0 if freeze_all else spec.warmup_steps,
                               optimizer_state=from_frozen_state(None if off_device else mode),
                               step_chunk_numel=auto_step_chunk_numel(spec.device, numel), **options)
    if scheduler is None:
        return None, ()
    names = tuple(scheduler.names)
    transfer = None
    if off_device:
        from .fake import OffDeviceHost

        transfer = OffDeviceHost()
    if freeze_all:
        never = tuple(n for n, _ in scheduler.held_frozen)   # embeddings="freeze": frozen in the base too
        scheduler.close()
        runs.set_frozen(model, names + never)
        if mode is not None:  # their state held as the scheduler would hold it (budget.py's base)
            from ...optim import FrozenState

            params = dict(model.named_parameters())
            FrozenState(optimizer, held, seed=spec.seed, transfer=transfer).freeze(
                [params[n] for n in names if n in params])
        return None, names
    scheduler.attach_optimizer(optimizer)
    if off_device:  # what optimizer_state "host-frozen" / "host" attaches, with the off-device host
        from ...optim import FrozenState

        FrozenState(optimizer, held, seed=scheduler.run_seed % 2**62, between_steps=between_steps,
                    transfer=transfer).attach(scheduler)
    scheduler.apply()
    return scheduler, names


@contextlib.contextmanager
def _building(fake):
    """Nothing for a real build; under a fake mode, ops on real tensors kept real (the probes' inputs) and the
    host reads of fake data in the patch's probes answered (fake.PlanMode)."""
    if fake is None:
        yield
        return
    from .fake import PlanMode, deepcopy_by_clone

    with fake, PlanMode(fake_mode=fake), deepcopy_by_clone():
        yield


def _inputs(spec: StepSpec, ref: ModelRef, model, fake, device: str) -> dict:
    """The batch on `device`: real for a real step; for a fake one (under `fake`), fake tensors of its shapes
    and dtypes, learnt from one real row (fake.fake_batch): nothing of the batch's size is allocated."""
    if fake is None:
        batch = make_batch(model, ref, spec.batch, spec.seq, spec.image_size, spec.seed)
        return {k: v.to(device) for k, v in batch.items()}
    from .fake import fake_batch

    return fake_batch(make_batch(model, ref, 1, spec.seq, spec.image_size, spec.seed), spec.batch, fake)


@contextlib.contextmanager
def open_step(spec: StepSpec, fake=None, ref: ModelRef | None = None, freeze_all: bool = False,
              budget: dict | None = None):
    """The spec's step, built (under `fake`, a FakeTensorMode, its tensors are fake: nothing allocated).
    freeze_all: every layer the scheduler would schedule frozen, no scheduler (budget.py's base). budget: with
    spec.budget_bytes, the scheduler's budget-mode arguments, computed by the caller (budget.scheduler_budget):
    the step builder does not plan, so the plan's modules import one way only."""
    ref = ref or resolve_model(spec.model, spec.task)
    check_spec(spec, ref, fake=fake is not None)
    if spec.budget_bytes is not None and budget is None and not freeze_all:
        raise ValueError("open_step: the spec asks for the scheduler's budget mode (budget_bytes); pass "
                         "budget=slimfit.plan.scheduler_budget(spec.replace(budget_bytes=None), spec.budget_bytes)")
    if spec.world_size > 1 and fake is None:
        raise ValueError(f"open_step: world_size={spec.world_size} is predicted only (a fake process group); a "
                         "sharded step runs on its ranks: measure it with python -m bench.sharded")
    from .sharding import process_group

    with process_group(spec.world_size) as mesh:
        with _open(spec, ref, fake, freeze_all, budget, mesh) as step:
            yield step


@contextlib.contextmanager
def _open(spec: StepSpec, ref: ModelRef, fake, freeze_all: bool, budget: dict | None, mesh):
    """open_step's body, inside the process group of a sharded spec (``mesh``: None for one process)."""
    import torch

    with _building(fake):
        model = _build(spec, ref, fake=fake, mesh=mesh)
        optimizer = _optimizer(spec, model, fake=fake is not None)
    # a fake run stays on the CPU whatever the spec's device (docs/plan.md: what a CUDA prediction is)
    run_device = "cpu" if fake is not None else spec.device
    inputs = _inputs(spec, ref, model, fake, run_device)
    # outside the fake mode: the scheduler's bookkeeping is real
    scheduler, scheduled = _scheduler(spec, model, optimizer, budget, freeze_all, fake=fake is not None)
    step = Step(spec, ref, model, inputs, optimizer, scheduler, scheduled=scheduled, run_device=run_device)
    if spec.lora:
        base = model.get_base_model()
        step.lora_targets, step.lora_heads = tuple(lora_targets(base, ref)), tuple(lora_heads(base, ref))
    step.params = sum(p.numel() for p in model.parameters())
    step.optimized = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    step.trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if scheduler is not None:
        step.layers, step.frozen_layers = scheduler.num_layers, len(scheduler.frozen_names())
        step.warmup_steps = scheduler.warmup_steps
    try:
        yield step
    finally:
        model.zero_grad(set_to_none=True)
        del step, model, optimizer, scheduler
        if torch.cuda.is_available() and spec.device == "cuda":
            torch.cuda.empty_cache()


def run_step(step: Step) -> None:
    """One whole training step without any measuring (what a timer times)."""
    loss = step.forward().loss
    loss.backward()
    del loss
    step.optimizer.step()
    step.optimizer.zero_grad(set_to_none=True)
    step.after_step()
