"""A planned configuration as the code a user pastes: the same step slimfit/memory/plan/step.py builds and the
prediction is about (checkpointing, then LoRA, then slimfit.patch; AdamW over the parameters that ever train;
the scheduler attached to it)."""
from __future__ import annotations

from ..models import CAUSAL_LM, IMAGE_CLS, ModelRef, resolve_model
from .fakerun import Prediction
from .spec import StepSpec

__all__ = ["render"]


def _model_lines(spec: StepSpec, ref: ModelRef) -> list[str]:
    """The model's lines: the user's model, its attention and gradient checkpointing."""
    cls = ref.model_class or {CAUSAL_LM: "AutoModelForCausalLM", IMAGE_CLS:
                               "AutoModelForImageClassification"}.get(ref.task, "AutoModelForSequenceClassification")
    lines = [f"model = ...  # your {cls} ({ref.name}), in train mode"]
    if spec.weight_dtype != "float32":
        lines.append(f"model.to(torch.{spec.weight_dtype})  # {spec.dtype} weights (or from_pretrained(..., "
                     f"torch_dtype=torch.{spec.weight_dtype}))")
    if spec.attn != "sdpa":
        lines.append(f'model.set_attn_implementation("{spec.attn}")')
    if spec.checkpointing:
        lines += ["model.config.use_cache = False",
                  'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})']
    return lines


def _lora_lines(p: Prediction) -> list[str]:
    """peft's LoRA as the prediction applied it (its targets and fully trained head)."""
    spec = p.spec
    if not spec.lora:
        return []
    save = f", modules_to_save={list(p.lora_heads)!r}" if p.lora_heads else ""
    return ["from peft import LoraConfig, get_peft_model",
            f"model = get_peft_model(model, LoraConfig(r={spec.lora}, lora_alpha={2 * spec.lora}, "
            f"target_modules={list(p.lora_targets)!r}{save}))"]


def _optimizer_lines(spec: StepSpec) -> list[str]:
    """AdamW (or torchao's or bitsandbytes' 8-bit) over the parameters that ever train: every one under the
    scheduler."""
    params = "model.parameters()" if spec.rate else "[p for p in model.parameters() if p.requires_grad]"
    imports = {"adamw8bit": "from torchao.optim import AdamW8bit", "adamw8bit-bnb": "import bitsandbytes as bnb"}
    lines = [imports[spec.optimizer]] if spec.optimizer in imports else []
    cls = {"adamw8bit": "AdamW8bit", "adamw8bit-bnb": "bnb.optim.AdamW8bit"}.get(spec.optimizer, "torch.optim.AdamW")
    if spec.step_in_backward:   # each parameter steps inside backward; optimizer.step() ends the step
        return lines + ["from slimfit.optim import step_in_backward",
                        f"optimizer = step_in_backward({params}, {cls}, lr=2e-5)"]
    return lines + [f"optimizer = {cls}({params}, lr=2e-5)"]


def _loop_lines(spec: StepSpec, device: str) -> list[str]:
    """The training loop: autocast for bf16, backward, optimizer step, zero_grad, the scheduler's step."""
    forward = "loss = model(**batch).loss"
    if spec.autocast:
        forward = f'with torch.autocast("{device}", dtype=torch.bfloat16):\n        {forward}'
    lines = [f"for batch in loader:  # {spec.shape()}",
             f"    {forward}", "    loss.backward()", "    optimizer.step()", "    optimizer.zero_grad()"]
    if spec.rate:
        lines.append("    scheduler.step()")
    return lines


def render(p: Prediction, budget_bytes: float | None = None) -> str:
    """The code of a predicted configuration's step. With budget_bytes and a freeze rate, the scheduler is
    given the budget and per-layer bytes (slimfit.plan.scheduler_budget), so that the frozen sets of later
    steps keep within it too."""
    spec = p.spec
    ref = resolve_model(spec.model, spec.task)
    lines = ["import torch"]
    if spec.preset != "none" or spec.chunked_loss:
        lines.append("import slimfit")
    lines += [""] + _model_lines(spec, ref) + _lora_lines(p)
    if spec.preset != "none":
        lines.append(f"model = slimfit.patch(model, slimfit.SlimFitConfig.{spec.preset}())")
    elif spec.chunked_loss:   # the chunked loss alone: a config that compresses nothing else
        lines.append("model = slimfit.patch(model, slimfit.SlimFitConfig(dropout=\"torch\", lm_head_chunk_rows=256))")
    device = "cuda" if spec.device == "cuda" else "cpu"
    lines += (['model.to("cuda")'] if device == "cuda" else []) + _optimizer_lines(spec)
    if spec.rate:
        lines.append("from slimfit.scheduler import ILSScheduler")
        if budget_bytes is not None:
            lines += ["from slimfit.plan import StepSpec, scheduler_budget",
                      f"budget = scheduler_budget(StepSpec({_model_arg(spec)!r}, batch={spec.batch}, "
                      f"{_shape_arg(spec)}, dtype={spec.dtype!r}, preset={spec.preset!r}, rate={spec.rate!r}, "
                      f"checkpointing={spec.checkpointing!r}{_in_backward_arg(spec)}"
                      f"{_frozen_state_arg(spec, p.causal_lm)}), "
                      f"budget_bytes={int(budget_bytes)})",
                      f"scheduler = ILSScheduler(model, freeze_rate={spec.rate!r}, optimizer=optimizer"
                      f"{_frozen_state_arg(spec, p.causal_lm)}, **budget)"]
        else:
            lines.append(f"scheduler = ILSScheduler(model, freeze_rate={spec.rate!r}, optimizer=optimizer"
                         f"{_frozen_state_arg(spec, p.causal_lm)})")
    return "\n".join(lines + [""] + _loop_lines(spec, device))


def _frozen_state_arg(spec: StepSpec, causal_lm: bool = False) -> str:
    """The scheduler's optimizer_state argument unless it is the scheduler's default ("auto"), and its
    warmup_steps where the predicted step differs from the default's first ("auto" ramps a causal LM's rate)."""
    state = "" if spec.optimizer_state == "auto" else f", optimizer_state={spec.optimizer_state!r}"
    default = spec.warmup_steps == "auto" or (spec.warmup_steps == 0 and not causal_lm)
    kinds = "" if spec.scheduled_kinds is None else f", scheduled_kinds={spec.scheduled_kinds!r}"
    code = "" if spec.state_code is None else f", state_code={spec.state_code!r}"
    embeddings = "" if spec.embeddings == "train" else f", embeddings={spec.embeddings!r}"
    return state + ("" if default else f", warmup_steps={spec.warmup_steps!r}") + kinds + code + embeddings


def _in_backward_arg(spec: StepSpec) -> str:
    """StepSpec's step_in_backward argument when set (the budget's step is the run's)."""
    return ", step_in_backward=True" if spec.step_in_backward else ""


def _model_arg(spec: StepSpec) -> str:
    """The model as StepSpec's first argument in the printed code."""
    return spec.model if isinstance(spec.model, str) else spec.model_name


def _shape_arg(spec: StepSpec) -> str:
    """seq= or image_size= for the printed StepSpec."""
    return f"seq={spec.seq}" if spec.seq is not None else f"image_size={spec.image_size}"
