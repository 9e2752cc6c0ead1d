"""One training configuration to plan: the model, the batch, and every choice that changes the step's memory.

A StepSpec is what `slimfit plan` predicts and what bench/plan_accuracy.py measures: both build the same
step from it (slimfit/memory/plan/step.py), so a prediction and its measurement differ only in how they run it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..._optimizer_state import FROZEN_STATE_NAMES, OPTIMIZER_STATES, resolve_state_mode, to_frozen_state
from .. import models

__all__ = ["StepSpec", "PRESETS", "OPTIMIZERS", "DTYPES", "FROZEN_STATES", "OPTIMIZER_STATES"]

PRESETS = ("none", "exact", "paper", "aggressive", "wta_crs")   # none: plain PyTorch; the rest SlimFitConfig's
OPTIMIZERS = ("adamw", "adamw8bit", "adamw8bit-bnb")
DTYPES = ("fp32", "bf16", "fp16", "bf16-autocast")   # weights in fp32/bf16/fp16; or fp32 weights under bf16 autocast
FROZEN_STATES = ("auto", None, "compress", "offload", "compress_all")   # optimizer_state's older names
_NO_FROZEN_STATE = "<frozen_state not given>"


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """A training step: model, batch shape, dtype, optimizer, slimfit preset, freeze rate, LoRA, checkpointing.

    model          an architecture name, a transformers config, a config path, a cached hub id or a ModelRef
    batch, seq     batch size and tokens per sequence (text); vision models take image_size (None: the config's)
    dtype          the weights' dtype: fp32, bf16 or fp16 (the model held in it, as from_pretrained(torch_dtype=...)
                   loads it; AdamW's moments in the weights' dtype, as torch makes them); or bf16-autocast (fp32
                   weights, the forward under torch.autocast in bf16)
    optimizer      adamw (torch.optim.AdamW), adamw8bit (torchao's AdamW8bit, when installed) or adamw8bit-bnb
                   (bitsandbytes' AdamW8bit, not paged: planned for device cuda, its fused step allocating
                   nothing; optim8bit.FakeBnbAdamW8bit)
    preset         none (plain PyTorch) or a SlimFitConfig preset applied with slimfit.patch (PRESETS)
    rate           ILSScheduler's freeze rate (0: no scheduler, every weight trains)
    lora           LoRA rank (peft; its default target modules for the family), None: full fine-tuning
    checkpointing  gradient checkpointing of every layer (use_reentrant=False)
    attn           attention of the unpatched model (sdpa, the transformers default, or eager)
    device         where the step runs: cpu, or cuda (predicted with fake CUDA tensors: not verified here)
    layers         the depth (None: the config's); tests and calibration use shallow copies
    task           overrides the task the config implies (text-classification, causal-lm, image-classification)
    seed           of the weights, the batch, dropout and the scheduler's first frozen set
    budget_bytes   with a rate: ILSScheduler's budget mode (slimfit.plan.scheduler_budget gives it the bytes)
    optimizer_state  with a rate: the scheduler's optimizer_state, how AdamW's moments are held ("auto", its
                   default: every layer's 8-bit with AdamW, nothing with adamw8bit; "8bit": every layer's;
                   "8bit-frozen": the frozen layers'; "host-frozen": the frozen layers' in host memory, which on a
                   CPU is the same memory; "full": as AdamW made them); `held_state` says what it comes to
    frozen_state   optimizer_state's older name ("auto", "compress_all", "compress", "offload", None), read as
                   it; the attribute gives optimizer_state in those names
    step_in_backward  the optimizer stepped inside backward (slimfit.optim.step_in_backward over the spec's
                   optimizer): each gradient freed right after its parameter's step, as torchtune's
                   optimizer_in_bwd; optimizer_state "host" needs it
    chunked_loss   a causal LM's loss through slimfit's chunked linear + cross-entropy (256 rows a chunk; no
                   B x S x vocab logits kept), without a preset too (torchtune's chunked CE); the presets do it
    warmup_steps   with a rate: the scheduler's warmup_steps for the predicted step, its first: 0 (the default
                   here) predicts the frozen set at the rate; "auto" (the scheduler's default: a causal LM's rate
                   ramps from 0 over 100 steps) or N > 0 predicts the ramp's first step, the run's worst
    scheduled_kinds  with a rate: the scheduler's scheduled_kinds (None, its default: the weight matrices, the
                   embeddings and norms training every step; "all"; or a selection such as ("matmul",
                   "embedding"): the embeddings scheduled too)
    state_code     with a rate and held moments: the scheduler's state_code (None, its default: "dynamic8"; or
                   "dynamic4": every held moment 4-bit, "linear8", ...)
    embeddings     with a rate: the scheduler's embeddings ("train", its default; "freeze": the input embedding
                   table, and a head tied to it, held frozen for the run)
    world_size     1: one process; N > 1: a rank of FSDP2 over N ranks (each transformer layer and the root
                   wrapped by fully_shard; batch per rank; predicted only: sharding.py)
    """

    model: Any
    batch: int
    seq: int | None = None
    image_size: int | None = None
    dtype: str = "fp32"
    optimizer: str = "adamw"
    preset: str = "none"
    rate: float = 0.0
    lora: int | None = None
    checkpointing: bool = False
    attn: str = "sdpa"
    device: str = "cpu"
    layers: int | None = None
    task: str | None = None
    seed: int = 0
    budget_bytes: float | None = None
    optimizer_state: str = "auto"
    frozen_state: str | None = dataclasses.field(default=_NO_FROZEN_STATE, compare=False, repr=False)
    step_in_backward: bool = False
    chunked_loss: bool = False
    warmup_steps: int | str = 0
    scheduled_kinds: str | tuple | None = None
    world_size: int = 1
    state_code: str | None = None
    embeddings: str = "train"

    def __post_init__(self):
        """Read frozen_state as optimizer_state, then refuse a spec with a wrong field at once, naming every
        problem."""
        problems = self._take_frozen_state() + self.problems()
        if problems:
            raise ValueError("StepSpec: " + "; ".join(problems))
        object.__setattr__(self, "frozen_state", to_frozen_state(self.optimizer_state))

    def _take_frozen_state(self) -> list[str]:
        """frozen_state, when given, read as optimizer_state; what is wrong with it."""
        legacy = self.frozen_state
        if isinstance(legacy, str) and legacy == _NO_FROZEN_STATE:
            return []
        if not (legacy is None or isinstance(legacy, str)) or legacy not in FROZEN_STATE_NAMES:
            return [f"frozen_state must be 'auto', None, 'compress', 'offload' or 'compress_all', got {legacy!r}"]
        if self.optimizer_state not in ("auto", FROZEN_STATE_NAMES[legacy]):
            return [f"optimizer_state={self.optimizer_state!r} and frozen_state={legacy!r} (its older name) "
                    "disagree: give optimizer_state alone"]
        object.__setattr__(self, "optimizer_state", FROZEN_STATE_NAMES[legacy])
        return []

    def problems(self) -> list[str]:
        """What is wrong with the fields (empty when nothing is)."""
        out = []
        if not isinstance(self.batch, int) or self.batch < 1:
            out.append(f"batch must be an int >= 1, got {self.batch!r}")
        if self.seq is not None and (not isinstance(self.seq, int) or self.seq < 1):
            out.append(f"seq must be an int >= 1, got {self.seq!r}")
        for name, value, allowed in (("dtype", self.dtype, DTYPES), ("optimizer", self.optimizer, OPTIMIZERS),
                                     ("preset", self.preset, PRESETS), ("attn", self.attn, ("sdpa", "eager")),
                                     ("device", self.device, ("cpu", "cuda"))):
            if value not in allowed:
                out.append(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if not isinstance(self.rate, (int, float)) or not 0.0 <= self.rate < 1.0:
            out.append(f"rate must be in [0, 1), got {self.rate!r}")
        if self.lora is not None and (not isinstance(self.lora, int) or self.lora < 1):
            out.append(f"lora must be a rank >= 1 or None, got {self.lora!r}")
        if self.lora is not None and self.rate:
            out.append("lora trains only the adapters (the base is frozen): give a freeze rate only without LoRA")
        if not isinstance(self.optimizer_state, str) or self.optimizer_state not in OPTIMIZER_STATES:
            out.append(f"optimizer_state must be one of {', '.join(OPTIMIZER_STATES)}, got {self.optimizer_state!r}")
        elif self.optimizer_state not in ("auto", "full") and not self.rate:
            out.append(f"optimizer_state={self.optimizer_state!r} holds the scheduler's layers' optimizer state: it "
                       "needs a freeze rate")
        elif self.optimizer_state not in ("auto", "full") and self.optimizer != "adamw":
            out.append(f"optimizer_state={self.optimizer_state!r} holds AdamW's moments: use it with optimizer adamw")
        out += self._switch_problems()
        out += self._kinds_problems() + self._code_problems() + self._embeddings_problems()
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            out.append(f"world_size must be an int >= 1 (the ranks FSDP2 shards over), got {self.world_size!r}")
        if self.budget_bytes is not None and (not self.rate or not self.budget_bytes > 0):
            out.append("budget_bytes (the scheduler's budget mode) needs a freeze rate and a number of bytes > 0")
        return out

    def _code_problems(self) -> list[str]:
        """What is wrong with state_code (one of the scheduler's codes; it needs a rate)."""
        if self.state_code is None:
            return []
        from ..._optimizer_state import STATE_CODES

        if self.state_code not in STATE_CODES:
            return [f"state_code must be one of {', '.join(STATE_CODES)}, got {self.state_code!r}"]
        if not self.rate:
            return ["state_code codes the moments the scheduler holds: it needs a freeze rate"]
        return []

    def _embeddings_problems(self) -> list[str]:
        """What is wrong with embeddings (one of the scheduler's values; other than "auto" it needs a rate)."""
        from ...scheduler.embeddings import EMBEDDINGS

        if self.embeddings not in EMBEDDINGS:
            return [f"embeddings must be one of {', '.join(EMBEDDINGS)}, got {self.embeddings!r}"]
        if self.embeddings != "train" and not self.rate:
            return [f"embeddings={self.embeddings!r} is the scheduler's: it needs a freeze rate"]
        return []

    def _kinds_problems(self) -> list[str]:
        """What is wrong with scheduled_kinds (the scheduler's own check, and it needs a rate)."""
        if self.scheduled_kinds is None:
            return []
        if not self.rate:
            return ["scheduled_kinds chooses what the scheduler freezes: it needs a freeze rate"]
        from ...scheduler import SchedulerConfig

        try:
            kinds = SchedulerConfig(scheduled_kinds=self.scheduled_kinds).scheduled_kinds
        except (TypeError, ValueError) as exc:
            return [str(exc)]
        object.__setattr__(self, "scheduled_kinds", kinds)
        return []

    def _switch_problems(self) -> list[str]:
        """What is wrong with warmup_steps and the on/off fields."""
        out = []
        steps = self.warmup_steps
        if not (steps == "auto" or (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0)):
            out.append(f"warmup_steps must be 'auto' or an int >= 0, got {steps!r}")
        for name in ("step_in_backward", "chunked_loss", "checkpointing"):
            if not isinstance(getattr(self, name), bool):
                out.append(f"{name} must be True or False, got {getattr(self, name)!r}")
        return out

    @property
    def held_state(self) -> str | None:
        """What optimizer_state comes to for this step, in frozen_state's names: None (nothing held: no
        scheduler, or a state slimfit does not compress, torchao's 8-bit AdamW), "compress", "offload" or
        "compress_all". The scheduler's rule (slimfit/_optimizer_state.py): torch's AdamW is under its chunked
        step, which can hold every state."""
        if not self.rate:
            return None
        return to_frozen_state(resolve_state_mode(self.optimizer_state, "every" if self.optimizer == "adamw" else
                                                  "none"))

    @property
    def weight_dtype(self) -> str:
        """The torch dtype name the model's weights are held in: bfloat16 or float16 for bf16/fp16 weights,
        float32 otherwise (bf16-autocast keeps fp32 weights)."""
        return {"bf16": "bfloat16", "fp16": "float16"}.get(self.dtype, "float32")

    @property
    def moment_bytes(self) -> int:
        """Bytes an element of one of AdamW's moments takes: the weights' dtype, as torch makes them."""
        return 4 if self.weight_dtype == "float32" else 2

    @property
    def autocast(self) -> bool:
        """Whether the forward runs under bf16 autocast (dtype bf16-autocast)."""
        return self.dtype == "bf16-autocast"

    @property
    def matmul_dtype(self) -> str:
        """The dtype the matrix products run in, for the time model (cost.py): bf16 for any 16-bit dtype."""
        return "fp32" if self.dtype == "fp32" else "bf16"

    def replace(self, **changes) -> "StepSpec":
        """A copy with `changes` (validated again; frozen_state read as optimizer_state)."""
        if "frozen_state" in changes and "optimizer_state" not in changes:
            changes = {**changes, "optimizer_state": "auto"}   # the legacy value decides
        return dataclasses.replace(self, **{"frozen_state": _NO_FROZEN_STATE, **changes})

    @property
    def model_name(self) -> str:
        """The model's name for tables and labels (the architecture name, the path, or the config's type)."""
        if isinstance(self.model, str):
            return self.model
        if isinstance(self.model, (models.ModelRef, models.Architecture)):
            return self.model.name
        return getattr(self.model, "name_or_path", "") or getattr(self.model, "model_type", "config")

    def label(self) -> str:
        """A short name of the configuration's choices (not the model or the batch)."""
        parts = [self.preset if self.preset != "none" else "plain"]
        if self.rate:
            parts.append(f"rate {self.rate:g}" + ("" if self.warmup_steps == 0 else
                                                  f", the first step of its ramp (warmup_steps={self.warmup_steps!r})"))
        if self.lora:
            parts.append(f"LoRA r{self.lora}")
        if self.checkpointing:
            parts.append("checkpointing")
        if self.step_in_backward:
            parts.append("step in backward")
        if self.chunked_loss and self.preset == "none":
            parts.append("chunked CE")
        if self.dtype != "fp32":
            parts.append("bf16 autocast" if self.autocast else f"{self.dtype} weights")
        if self.optimizer != "adamw":
            parts.append(self.optimizer)
        if self.rate and self.optimizer == "adamw":
            bits = "4-bit" if (self.state_code or "").startswith("dynamic4") else "8-bit"
            parts.append({None: "frozen state in full", "compress": f"frozen state {bits}",
                          "offload": "frozen state offloaded", "compress_all": f"every state {bits}",
                          "offload_all": "every state on the host"}[self.held_state])
            if self.state_code is not None and self.held_state in ("compress", "compress_all"):
                parts.append(f"code {self.state_code}")
        if self.world_size > 1:
            parts.append(f"FSDP2 rank of {self.world_size}")
        if self.budget_bytes is not None:
            parts.append(f"scheduler budget {self.budget_bytes / 2**30:.2f} GiB")
        if self.scheduled_kinds is not None:
            kinds = self.scheduled_kinds
            parts.append(f"scheduled: {kinds if isinstance(kinds, str) else ' + '.join(kinds)}")
        if self.embeddings == "freeze":
            parts.append("input embedding held frozen")
        return ", ".join(parts)

    def shape(self) -> str:
        """batch and sequence (or image) as text."""
        if self.seq is not None:
            return f"batch {self.batch}, seq {self.seq}"
        return f"batch {self.batch}, image {self.image_size or 'default'}"
