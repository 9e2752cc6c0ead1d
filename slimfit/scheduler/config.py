"""SchedulerConfig: every option of the ILS scheduler, in one validated frozen dataclass.

``ILSScheduler(model, config)`` reads its options from here and nowhere else; keywords
(``ILSScheduler(model, freeze_rate=0.7)``) are a shorthand for the fields (``SchedulerConfig.from_options``).
Each field is checked once, in ``__post_init__``, and a bad value raises an error that names the field,
what it must be and how to fix it, instead of failing later deep inside the scheduler.

Options measured neutral or harmful (docs/fidelity.md) are kept apart, in ``experimental``
(``ExperimentalOptions``), off by default: they stay available to reproduce those runs, but they are not
part of the main surface. The keyword shorthand reaches them by name (``frozen_update="momentum"``,
``warmup_start_rate=0.35``, ``score="absolute"``).

A config is saved beside a checkpoint like ``slimfit.SlimFitConfig``: ``to_dict`` / ``from_dict`` (with a
``version``), ``save_pretrained`` / ``from_pretrained`` (``slimfit_scheduler.json``).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from slimfit._config_base import ConfigBase, read_version, refuse_unknown
from slimfit._config_base import choice as _choice
from slimfit._config_base import closest as _closest
from slimfit._config_base import did_you_mean as _did_you_mean
from slimfit._config_base import error as _error
from slimfit._config_base import flag as _flag
from slimfit._config_base import integer as _int
from slimfit._config_base import is_number as _is_number
from slimfit._config_base import number_fix as _number_fix
from slimfit._config_base import real as _real
from slimfit._config_base import shown as _shown
from slimfit._optimizer_state import (
    AUTO_STEP_CHUNK,
    DEFAULT_OPTIMIZER_STATE,
    DEFAULT_STEP_CHUNK_NUMEL,
    FROZEN_STATES,
    OPTIMIZER_STATES,
    STATE_CODES,
    from_frozen_state,
    resolve_state_mode,
    to_frozen_state,
)

from .candidates import KINDS, TASK_HEAD
from .embeddings import EMBEDDINGS
from .optim import FROZEN_UPDATES
from .scores import DEFAULT_CHUNK_NUMEL, SCORES
from .selection import ROUNDINGS

__all__ = ["SchedulerConfig", "ExperimentalOptions", "CONFIG_VERSION", "CONFIG_NAME", "ALL_KINDS",
           "DEFAULT_SCHEDULED_KINDS", "EVEN_SHARE", "MAIN_SCORES", "EXPERIMENTAL_SCORES", "UPDATE_SCALES",
           "RUNTIME_FIELDS", "OPTIMIZER_STATES", "STATE_CODES", "DEFAULT_STEP_CHUNK_NUMEL", "AUTO_WARMUP",
           "DECODER_WARMUP_STEPS"]

# to_dict()'s "version": bumped when a saved field changes meaning; from_dict refuses the versions it does not know.
CONFIG_VERSION = 1
CONFIG_NAME = "slimfit_scheduler.json"
# scheduled_kinds="all": every kind of candidate (SlimFit's rule); None: the weight matrices only.
ALL_KINDS = "all"
DEFAULT_SCHEDULED_KINDS = ("matmul",)
# min_train_share="even": every layer trains in the share of layers that train each step.
EVEN_SHARE = "even"
# The scores on the main surface; the others are experimental (ExperimentalOptions.score).
MAIN_SCORES = ("relative", "robust")
EXPERIMENTAL_SCORES = tuple(s for s in SCORES if s not in MAIN_SCORES)
# update_scale: "none" leaves the optimizer's updates alone; "share" stretches each trained layer's update by
# its catch-up factor (steps so far / steps it trained, capped at layers / trained layers); "sqrt_share" by the
# square root of it.
UPDATE_SCALES = ("none", "share", "sqrt_share")
# warmup_steps="auto": the rate ramps from 0 over DECODER_WARMUP_STEPS steps for a causal LM, not at all for
# other models (the short decoder protocols against the encoder ones, docs/fidelity.md).
AUTO_WARMUP = "auto"
DECODER_WARMUP_STEPS = 100
# Fields that bind a config to one process or one model object rather than describe the schedule: a
# scheduler's state_dict leaves them out (it saves the layer names and shapes instead).
RUNTIME_FIELDS = ("layers", "activation_bytes", "distributed", "process_group", "chunk_numel", "step_chunk_numel")
# step_chunk_numel's default (DEFAULT_STEP_CHUNK_NUMEL), optimizer_state's values (OPTIMIZER_STATES) and the
# codes of state_code (STATE_CODES) are the optimizer state's vocabulary: slimfit/_optimizer_state.py, shared
# with slimfit.optim and the planner. A frozen_state value given for optimizer_state (FROZEN_STATES) is read
# as its optimizer_state name.
_NO_FROZEN_STATE = "<frozen_state not given>"
# weight_rounding: how the chunked step writes bf16 / fp16 weights: "nearest" (torch's step, bit for bit) or
# "stochastic" (the update computed in fp32, the weight rounded stochastically: slimfit/optim/weight_rounding.py);
# the config's "auto" is "stochastic" under the chunked step (effective_weight_rounding).
WEIGHT_ROUNDINGS = ("nearest", "stochastic")
AUTO_WEIGHT_ROUNDING = "auto"
# What to_dict writes for a value only the saving process has (a callable, a process group).
NOT_SAVED = "<not saved: an object of the saving process>"


# ---------------------------------------------------------------------------------------------- checks
# The checks and their error style are the ones slimfit.SlimFitConfig uses too (slimfit/_config_base.py).


# ---------------------------------------------------------------------------------------------- fields
_C = "SchedulerConfig"


def _score(cfg, value):
    if isinstance(value, str) and value in EXPERIMENTAL_SCORES:
        return _choice(_C, "score", value, MAIN_SCORES,
                       f"score={value!r} is experimental (docs/fidelity.md): "
                       f"SchedulerConfig(experimental=ExperimentalOptions(score={value!r})), or the keyword "
                       f"shorthand ILSScheduler(model, score={value!r})")
    return _choice(_C, "score", value, MAIN_SCORES)


def _scheduled_kinds(cfg, value):
    if value is None or (isinstance(value, str) and value == ALL_KINDS):
        return value
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple, set)) else None
    bad = [k for k in names or () if not (isinstance(k, str) and k in KINDS)]
    if names is None or not names or bad:
        fix = _did_you_mean(bad[0], (*KINDS, ALL_KINDS)) if bad else "e.g. scheduled_kinds=('matmul', 'norm')"
        raise _error(_C, "scheduled_kinds", f"{ALL_KINDS!r}, None (the weight matrices) or a non-empty selection "
                     f"of {KINDS}", value, fix)
    return tuple(k for k in KINDS if k in names)


def _always_train(cfg, value):
    if value is None or (isinstance(value, str) and value == TASK_HEAD):
        return value
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if names is None or any(not isinstance(n, str) or not n for n in names):
        raise _error(_C, "always_train", f"None (a task model's head), {TASK_HEAD!r}, or module names such as "
                     "['classifier'] (() schedules every candidate, SlimFit's rule)", value)
    return tuple(names)


def _layers(cfg, value):
    rule = "None or a non-empty list of parameter names (or (name, parameter) pairs)"
    if value is None:
        return None
    if isinstance(value, (str, torch.Tensor)) or not isinstance(value, Iterable):
        raise _error(_C, "layers", rule, value, "e.g. layers=['encoder.0.weight']")
    items = []
    for item in value:
        if isinstance(item, str):
            items.append(item)
        elif (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
              and isinstance(item[1], torch.Tensor)):
            items.append((item[0], item[1]))
        else:
            raise _error(_C, "layers", rule, item, "each element a name such as 'fc1.weight' or a pair "
                         "from model.named_parameters()")
    if not items:
        raise _error(_C, "layers", rule, value, "leave layers=None to schedule the default candidates")
    return tuple(items)


def _activation_bytes(cfg, value):
    if value is None or (callable(value) and not isinstance(value, Mapping)):
        return value
    if not isinstance(value, Mapping):
        raise _error(_C, "activation_bytes", "None, a dict {layer name: bytes} or a callable (name, param) -> bytes",
                     value, "slimfit.scheduler.estimate_activation_bytes(model, batch) measures the dict")
    for name, nbytes in value.items():
        if not isinstance(name, str):
            raise _error(_C, "activation_bytes", "keyed by parameter names (str)", name)
        if not _is_number(nbytes) or not math.isfinite(float(nbytes)) or nbytes < 0:
            raise _error(_C, f"activation_bytes[{name!r}]", "a finite number of bytes >= 0", nbytes,
                         "estimate_activation_bytes(model, batch) measures them")
    return dict(value)


def _min_train_share(cfg, value):
    if isinstance(value, str) and value == EVEN_SHARE:
        return value
    top = 1.0 - cfg.freeze_rate
    rule = (f"in [0, 1 - freeze_rate] = [0, {top:g}] (no more than the share of layers that train each step) "
            f"or {EVEN_SHARE!r}")
    if not _is_number(value) or not (0.0 <= float(value) <= top + 1e-12):
        if _is_number(value):
            fix = "lower min_train_share or freeze_rate"
        else:
            fix = _did_you_mean(value, (EVEN_SHARE,)) or _number_fix("min_train_share", value, 0.1)
        raise _error(_C, "min_train_share", rule, value, fix)
    return float(value)


def _seed(cfg, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not -2**63 <= value < 2**64:
        raise _error(_C, "seed", "an int (seeds the initial random scores, i.e. the round-robin order)", value,
                     _number_fix("seed", value, 0))
    return int(value)


def _process_group(cfg, value):
    if value is not None and cfg.distributed is False:
        raise _error(_C, "process_group", "None when distributed=False", value,
                     "drop process_group, or set distributed=None (auto) or True")
    return value


def _weight_rounding(cfg, value):
    value = _choice(_C, "weight_rounding", value, (AUTO_WEIGHT_ROUNDING, *WEIGHT_ROUNDINGS))
    if value == "stochastic" and cfg.step_chunk_numel is None:
        raise _error(_C, "weight_rounding", "'nearest' when step_chunk_numel is None (the stochastic rounding is "
                     "done by the chunked step)", value, "keep step_chunk_numel (the default, 'auto')")
    return value


def _step_chunk_numel(cfg, value):
    if isinstance(value, str) and value == AUTO_STEP_CHUNK:
        return value
    return _int(_C, "step_chunk_numel", value, 1, f"elements per call of the optimizer step; or {AUTO_STEP_CHUNK!r}",
                DEFAULT_STEP_CHUNK_NUMEL, optional=True)


def _warmup_steps(cfg, value):
    if isinstance(value, str) and value == AUTO_WARMUP:
        return value
    return _int(_C, "warmup_steps", value, 0, f"steps of the rate's ramp; or {AUTO_WARMUP!r}", 100)


def _experimental(cfg, value):
    if not isinstance(value, ExperimentalOptions):
        raise TypeError(f"{_C}.experimental must be ExperimentalOptions(...), got {_shown(value)}; e.g. "
                        "experimental=ExperimentalOptions(frozen_update='momentum')")
    return value


# Each field's check, in field order (min_train_share needs freeze_rate, process_group needs distributed).
_CHECKS = {
    "freeze_rate": lambda c, v: _real(_C, "freeze_rate", v, "in [0, 1) (a number: the fraction of the scheduled "
                                      "layers frozen each step)", lambda r: 0.0 <= r < 1.0, 0.7),
    "score": _score,
    "rounding": lambda c, v: _choice(_C, "rounding", v, ROUNDINGS),
    "scheduled_kinds": _scheduled_kinds,
    "always_train": _always_train,
    "embeddings": lambda c, v: _choice(_C, "embeddings", v, EMBEDDINGS),
    "layers": _layers,
    "min_train_share": _min_train_share,
    "update_scale": lambda c, v: _choice(_C, "update_scale", v, UPDATE_SCALES),
    "warmup_steps": _warmup_steps,
    "min_trained_steps": lambda c, v: _int(_C, "min_trained_steps", v, 0, "steps a layer stays trained", 2),
    "min_frozen_steps": lambda c, v: _int(_C, "min_frozen_steps", v, 0, "steps a layer stays frozen", 2),
    "seed": _seed,
    "memory_aware": lambda c, v: _flag(_C, "memory_aware", v),
    "activation_bytes": _activation_bytes,
    "budget_bytes": lambda c, v: None if v is None else _real(
        _C, "budget_bytes", v, "None or a finite number of bytes > 0", lambda b: b > 0, "2**30"),
    "base_bytes": lambda c, v: _real(_C, "base_bytes", v, "a finite number of bytes >= 0", lambda b: b >= 0, 0),
    "release_state_after": lambda c, v: _int(_C, "release_state_after", v, 1, "consecutive frozen steps", 50,
                                             optional=True),
    "optimizer_state": lambda c, v: _choice(_C, "optimizer_state", v, OPTIMIZER_STATES),
    "state_code": lambda c, v: _choice(_C, "state_code", v, tuple(STATE_CODES)),
    "distributed": lambda c, v: _flag(_C, "distributed", v, optional=True),
    "process_group": _process_group,
    "chunk_numel": lambda c, v: _int(_C, "chunk_numel", v, 1, "elements per batched score reduction", 2**25),
    "step_chunk_numel": _step_chunk_numel,
    "weight_rounding": _weight_rounding,
    "experimental": _experimental,
}


# ---------------------------------------------------------------------------------------------- classes
@dataclass(frozen=True)
class ExperimentalOptions:
    """Scheduler options measured neutral or harmful in docs/fidelity.md, off by default. They are kept to
    reproduce those runs and for further experiments; none is part of a recommended setup.

    frozen_update  "none" (default): a frozen layer stands still. "momentum": a frozen layer that has
                   optimizer state keeps taking the optimizer's step from its moments (a zero gradient is
                   handed to the optimizer), as SlimFit's published code did on the PyTorch of its time.
    warmup_start_rate  the rate of the ramp's first step (SchedulerConfig.warmup_steps), in [0, 1) (0, the
                   default: nothing frozen at first); above freeze_rate it is freeze_rate. A higher start bounds
                   what the ramp adds to the worst step's peak (from 0.35, +8% on BERT-base b16 against +16%)
                   and cost 3 points on the fortunes decoder protocol (docs/fidelity.md).
    score          None (default: SchedulerConfig.score decides) or "absolute": mean |W_new - W_old|, how
                   far the weights moved, not divided by their size.
    """

    frozen_update: str = "none"
    warmup_start_rate: float = 0.0
    score: Optional[str] = None

    def __post_init__(self):
        o = "ExperimentalOptions"
        _choice(o, "frozen_update", self.frozen_update, FROZEN_UPDATES)
        object.__setattr__(self, "warmup_start_rate", _real(
            o, "warmup_start_rate", self.warmup_start_rate, "in [0, 1) (the ramp's first rate)",
            lambda r: 0.0 <= r < 1.0, 0.35))
        if self.score is not None:
            fix = (f"score={self.score!r} is not experimental: SchedulerConfig(score={self.score!r})"
                   if self.score in MAIN_SCORES else "")
            _choice(o, "score", self.score, EXPERIMENTAL_SCORES, fix)


@dataclass(frozen=True, eq=False, repr=False)
class SchedulerConfig(ConfigBase):
    """Every option of :class:`ILSScheduler`, validated once, here (save_pretrained / from_pretrained:
    slimfit/_config_base.py's ConfigBase, file slimfit_scheduler.json).

    freeze_rate        fraction of the scheduled layers frozen each step, in [0, 1); at least one layer
                       always trains. In budget mode the minimum fraction frozen. Default 0.7: 0.9 costs
                       accuracy on harder tasks (docs/fidelity.md, "Freeze rate").
    score              "relative" (SlimFit's: mean |ΔW / W_old| over entries with W_old != 0) or "robust"
                       (||ΔW|| / ||W_old||, which does not blow up on near-zero weights).
    rounding           "round" (round(rate * L), halves up) or "floor" (int(rate * L), the paper's code).
    scheduled_kinds    which kinds of candidate are scheduled: "all" (SlimFit's rule) or a selection of
                       "matmul", "norm", "embedding"; the other candidates train every step. None: ("matmul",)
                       (freezing an embedding or a norm weight saves no activation memory, and SlimFit's score
                       starves them), or every kind when `layers` lists the layers.
    always_train       module (or parameter) names that train every step and are not scheduled, e.g.
                       ("classifier",); "task_head": a Hugging Face task model's fresh head (an error when
                       there is none). None: that head when the model has one and `layers` is not given;
                       () schedules it like any layer (SlimFit's rule). Scheduled, a fresh head trains too
                       rarely (docs/fidelity.md).
    embeddings         "train" (the default): the input embedding table trains every step, or is scheduled (a tied
                       table is a weight matrix; scheduled_kinds with "embedding" schedules an untied one).
                       "freeze": a transformers model's input embedding table (and a head tied to it: the same
                       parameter) does not train in this run: requires_grad off from the scheduler's start to its
                       close(), so it holds no gradient and no optimizer state (Qwen2.5-0.5B's table is 136M of
                       494M parameters); it cost the many-answer decoder protocol a point (embeddings.py;
                       docs/fidelity.md).
    layers             with a model: parameter names (or (name, parameter) pairs) to schedule instead of the
                       default candidates; checked against the model. None: the candidates.
    min_train_share    every layer trains in at least this share of the steps so far, in [0, 1 - freeze_rate];
                       "even": every layer equally often (a round robin the scores order). 0: the scores alone.
    update_scale       "share": each trained layer's update is stretched by its catch-up factor, steps so far /
                       steps it trained (capped at layers / trained layers), so a layer that trains one step in
                       three travels about as far as under full fine-tuning; "sqrt_share": by its square root
                       (the step noise of full fine-tuning); inside the chunked step it is the learning rate
                       times the factor (no snapshot), else the update stretched after the step. "none" (the
                       default): the optimizer's updates as they are (docs/fidelity.md).
    warmup_steps       the freeze rate ramps linearly from 0 (experimental.warmup_start_rate) to freeze_rate
                       over this many steps: more layers train, and keep activations, early on, so the first
                       step's peak is the run's highest. "auto" (the default): DECODER_WARMUP_STEPS (100) for a
                       causal LM, 0 otherwise (resolve_warmup_steps): freezing 70% from the first step cost a
                       short decoder fine-tune 9 points, and the ramp changed nothing measurable on the encoder
                       protocols (docs/fidelity.md). 0: the rate from the first step.
    min_trained_steps / min_frozen_steps   a layer, once unfrozen / frozen, stays so that many steps at least
                       (soft: the frozen count and the budget win), against thrashing.
    seed               seeds the initial random scores (the round-robin order); rank 0's wins under DDP.
    memory_aware       rank layers by score per activation byte, so freezing prefers the layers that save
                       the most memory (needs activation_bytes).
    activation_bytes   activation bytes that training each layer costs: a dict {name: bytes} (missing names
                       cost 0) or a callable (name, param) -> bytes; see estimate_activation_bytes.
    budget_bytes       budget mode: keep base_bytes + the bytes of the trained layers at or under this.
    base_bytes         activation bytes no freezing removes (the unscheduled candidates' bytes are added).
    release_state_after  with an attached optimizer, drop a layer's optimizer state once it has been frozen
                       this many consecutive steps (it restarts from fresh state). None: keep all state.
    optimizer_state    with an attached optimizer, how its state (AdamW's moments) is held: "8bit" (every
                       layer's moments 8-bit, the trained ones too: updated a piece at a time inside the chunked
                       step, or between their own steps with step_in_backward; an 8-bit AdamW), "8bit-frozen"
                       (the frozen layers' moments 8-bit while frozen: 3.76x fewer bytes, lossy), "host-frozen"
                       (the frozen layers' moments in host memory while frozen; on a GPU, lossless), "host"
                       (every layer's moments in host memory, streamed to the device a piece at a time inside the
                       chunked step or the step in backward; lossless) or "full" (as the optimizer made it)
                       (docs/optim.md).
                       "auto" (the default): "8bit" where the optimizer's step can hold every state (a torch
                       Adam/AdamW under the chunked step, or step_in_backward), else "8bit-frozen"; "full" under
                       experimental frozen_update="momentum"; chosen by the accuracy protocols
                       (docs/fidelity.md). One rule, shared with slimfit.optim and the planner:
                       slimfit/_optimizer_state.py's resolve_state_mode (``state_mode()``).
                       ``frozen_state=`` (keyword, saved configs) is its older name, read as it: "auto",
                       "compress_all" ("8bit"), "compress" ("8bit-frozen"), "offload" ("host-frozen"), "offload_all"
                       ("host"), None ("full"); the attribute ``frozen_state`` gives optimizer_state in those names.
    state_code         how optimizer_state="8bit-frozen" / "8bit" code a moment: "dynamic8" (the default) or
                       "dynamic4": block-wise dynamic codes (a signed map for the first moment, sqrt(v) on a map
                       without zero for the second), stochastic rounding from the codec's seed (a moment
                       re-encoded at every step follows a change smaller than a level); "linear8": 8-bit
                       per-group min/max, stochastic rounding, unbiased; "dynamic8-nearest" /
                       "dynamic4-nearest" the dynamic codes rounded to nearest (they hold a slowly changing
                       moment in place); the default by the accuracy protocols (docs/fidelity.md). A config
                       saved without the field loads as "linear8" (its run's code).
    distributed        None: auto (torch.distributed initialised, world size > 1); True / False to force.
    process_group      the group to agree within (default: the world).
    chunk_numel        elements per batched score reduction (bounds temporary memory).
    step_chunk_numel   with an attached torch Adam/AdamW (not capturable), its step updates at most this many
                       elements at a time (the same arithmetic, the same weights bit for bit) and the trained
                       layers are scored as they are updated, so neither torch's temporaries the size of the
                       largest (CPU) or of every (CUDA foreach) trained parameter nor the weight snapshots
                       exist (slimfit.optim.ChunkedStep; docs/optim.md). None: the optimizer's own step.
                       "auto" (the default): 2**20 on the CPU; on a GPU the optimizer's parameters' numel / 256
                       (a power of two in [2**20, 2**24]: fewer, larger calls where each call costs kernel
                       launches; slimfit/_optimizer_state.py).
    weight_rounding    how the chunked step writes bf16 / fp16 weights: "stochastic" (each piece's update
                       computed in fp32, the weight rounded to a neighbour with the probability that makes its
                       expectation the fp32 result, seeded from the run's seed; as torchao's
                       bf16_stochastic_round; docs/optim.md) or "nearest" (torch's step bit for bit; an update
                       below half a bf16 ulp of a weight is lost: 11 points of the two-answer decoder protocol
                       in bf16 weights, docs/fidelity.md). "auto" (the default): "stochastic" under the chunked
                       step, "nearest" without it (step_chunk_numel=None). fp32 weights are the same either way.
                       A config saved without the field loads as "nearest", as that run rounded.
    experimental       ExperimentalOptions: options measured neutral or harmful, off by default.
    version            the format of to_dict(); set by slimfit, not an argument.

    Changing a config: ``cfg.replace(seed=1)``; experimental fields by name too
    (``cfg.replace(frozen_update="momentum")``).
    """

    freeze_rate: float = 0.7
    score: str = "relative"
    rounding: str = "round"
    scheduled_kinds: Union[str, tuple, None] = None
    always_train: Union[str, tuple, None] = None
    embeddings: str = "train"
    layers: Optional[tuple] = None
    min_train_share: Union[float, str] = 0.0
    update_scale: str = "none"
    warmup_steps: Union[int, str] = AUTO_WARMUP
    min_trained_steps: int = 0
    min_frozen_steps: int = 0
    seed: int = 0
    memory_aware: bool = False
    activation_bytes: Union[Mapping, Callable, None] = None
    budget_bytes: Optional[float] = None
    base_bytes: float = 0.0
    release_state_after: Optional[int] = None
    optimizer_state: str = DEFAULT_OPTIMIZER_STATE
    state_code: str = "dynamic8"
    distributed: Optional[bool] = None
    process_group: Any = None
    chunk_numel: int = DEFAULT_CHUNK_NUMEL
    step_chunk_numel: Union[int, str, None] = AUTO_STEP_CHUNK
    weight_rounding: str = AUTO_WEIGHT_ROUNDING
    experimental: ExperimentalOptions = field(default_factory=ExperimentalOptions)
    version: int = field(default=CONFIG_VERSION, init=False)
    # optimizer_state's older name, read as it (not a field: to_dict writes optimizer_state); the attribute
    # frozen_state reads optimizer_state back in that vocabulary (the property below the class).
    frozen_state: dataclasses.InitVar[Optional[str]] = _NO_FROZEN_STATE

    CONFIG_NAME = CONFIG_NAME          # the JSON file of save_pretrained (not a field: no annotation)
    CONFIG_VERSION = CONFIG_VERSION

    def __post_init__(self, frozen_state=_NO_FROZEN_STATE):
        _take_frozen_state(self, frozen_state)
        for name, check in _CHECKS.items():
            object.__setattr__(self, name, check(self, getattr(self, name)))
        if (self.memory_aware or self.budget_bytes is not None) and self.activation_bytes is None:
            raise ValueError("SchedulerConfig: memory_aware=True and budget_bytes need activation_bytes (a dict "
                             "name -> bytes or a callable); slimfit.scheduler.estimate_activation_bytes(model, batch) "
                             "measures them")
        if self.optimizer_state not in ("auto", "full") and self.experimental.frozen_update != "none":
            raise ValueError(f"SchedulerConfig: optimizer_state={self.optimizer_state!r} holds the frozen layers' "
                             "optimizer state, while experimental frozen_update='momentum' steps them with it every "
                             "step; keep one (optimizer_state='full', frozen_state=None, for the momentum runs)")
        if self.embeddings == "freeze" and "embedding" in self.kinds:
            raise ValueError('SchedulerConfig: embeddings="freeze" holds the input embedding frozen for the run, while '
                             f"scheduled_kinds={self.scheduled_kinds!r} schedules it; keep one (embeddings=\"train\" "
                             "to schedule it)")
        if self.experimental.score is not None and self.score != "relative":
            raise ValueError(f"SchedulerConfig: score={self.score!r} and experimental.score="
                             f"{self.experimental.score!r} ask for two scores; keep one")

    # ------------------------------------------------------------------ what the scheduler reads
    @property
    def kinds(self) -> tuple:
        """The kinds scheduled: scheduled_kinds with None and "all" resolved."""
        kinds = self.scheduled_kinds
        if kinds is None:
            kinds = ALL_KINDS if self.layers is not None else DEFAULT_SCHEDULED_KINDS
        return KINDS if kinds == ALL_KINDS else kinds

    def state_mode(self, step: str = "every") -> Optional[str]:
        """What optimizer_state holds with an optimizer whose step can hold ``step`` ("every", "frozen" or
        "none"; slimfit/_optimizer_state.py's resolve_state_mode, the one rule): "8bit", "8bit-frozen",
        "host-frozen" or None (nothing: "full", or "auto" under the experimental frozen_update="momentum",
        which steps frozen layers with that state)."""
        return resolve_state_mode(self.optimizer_state, step, self.experimental.frozen_update != "none")

    @property
    def frozen_state_mode(self) -> Optional[str]:
        """state_mode() where the step can hold every state, in frozen_state's names ("compress_all",
        "compress", "offload" or None), for code written against those names."""
        return to_frozen_state(self.state_mode("every"))

    @property
    def effective_weight_rounding(self) -> str:
        """How the chunked step writes bf16 / fp16 weights: weight_rounding with "auto" resolved ("stochastic"
        under the chunked step, "nearest" without one)."""
        if self.weight_rounding != AUTO_WEIGHT_ROUNDING:
            return self.weight_rounding
        return "nearest" if self.step_chunk_numel is None else "stochastic"

    @property
    def effective_score(self) -> str:
        """The score the scheduler computes: experimental.score when set, else score."""
        return self.experimental.score or self.score

    # ------------------------------------------------------------------ building and changing
    @classmethod
    def from_options(cls, config=None, /, **options) -> "SchedulerConfig":
        """``config`` (a SchedulerConfig, a number: the freeze rate, or None: the defaults) with ``options``
        applied: field names, experimental ones included (``frozen_update="momentum"``,
        ``score="absolute"``). This is ILSScheduler's keyword shorthand. An unknown name is a TypeError
        that lists the valid ones."""
        if config is None:
            config = cls()
        elif _is_number(config):
            if "freeze_rate" in options:
                raise TypeError("the freeze rate is given twice: as the config argument and as freeze_rate=")
            config, options = cls(), {"freeze_rate": config, **options}
        elif not isinstance(config, cls):
            raise TypeError(f"config must be a SchedulerConfig or a freeze rate (a number such as 0.7), got "
                            f"{_shown(config)}{_config_hint(config)}")
        if not options:
            return config
        # frozen_state: given, it was read as optimizer_state by _route; not given, not the base's read back
        return dataclasses.replace(config, **_route(config, options), frozen_state=_NO_FROZEN_STATE)

    def replace(self, **changes) -> "SchedulerConfig":
        """This config with fields changed, experimental ones by name too (validated again)."""
        return type(self).from_options(self, **changes)

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def _key(self) -> tuple:
        """The fields, comparable: layer pairs by name and parameter identity (not by tensor values)."""
        def comparable(value):
            if isinstance(value, dict):
                return tuple(sorted(value.items()))
            if isinstance(value, tuple):
                return tuple((v[0], id(v[1])) if isinstance(v, tuple) else v for v in value)
            return value
        return tuple(comparable(getattr(self, f.name)) for f in dataclasses.fields(self))

    def __repr__(self) -> str:
        default = type(self)()
        changed = [f"{f.name}={_repr_value(getattr(self, f.name))}" for f in dataclasses.fields(self)
                   if f.init and _differs(getattr(self, f.name), getattr(default, f.name))]
        return f"SchedulerConfig({', '.join(changed)})"

    # ------------------------------------------------------------------ checkpoints
    def to_dict(self, nested: bool = True) -> dict:
        """Plain values (JSON-ready) with ``version``: tuples as lists, layer pairs as their names, objects
        of this process (a callable activation_bytes, a process group) as a marker that from_dict refuses
        unless they are given again. ``nested=False``: the experimental fields at the top level, named as
        the keyword shorthand names them (``score`` is then the experimental score when one is set)."""
        out: dict = {"version": self.version}
        for f in dataclasses.fields(self):
            if f.name not in ("version", "experimental"):
                out[f.name] = _saveable(getattr(self, f.name))
        part = dataclasses.asdict(self.experimental)
        if nested:
            out["experimental"] = part
            return out
        score = part.pop("score")
        out.update(part)
        if score is not None:
            out["score"] = score
        return out

    @classmethod
    def from_dict(cls, values, /, **changes) -> "SchedulerConfig":
        """A config from ``to_dict()``'s output (nested or flat; a flat dict without ``version``, such as a
        scheduler state's ``"config"``, is read as this version). ``changes`` are applied first: give them
        for the fields saved as objects of the saving process (activation_bytes=fn, process_group=g)."""
        if not isinstance(values, Mapping):
            raise TypeError(f"SchedulerConfig.from_dict expects a dict (to_dict()'s output), got {_shown(values)}")
        values = dict(values)
        read_version(_C, values, CONFIG_VERSION)
        refuse_unknown(f"{_C}.from_dict", values, _SHORTHAND)
        if isinstance(values.get("experimental"), Mapping):
            for name in _PROMOTED:   # saved when the field was experimental
                if name in values["experimental"]:
                    values.setdefault(name, values["experimental"][name])
            values["experimental"] = _experimental_from_dict(values["experimental"])
        _optimizer_state_from_dict(values)
        values.setdefault("state_code", "linear8")
        values.setdefault("warmup_steps", 0)   # saved before "auto": that run froze from its first step
        values.setdefault("weight_rounding", "nearest")   # and rounded its bf16 weights to nearest
        values.update(changes)
        lost = sorted(k for k, v in values.items() if isinstance(v, str) and v == NOT_SAVED)
        if lost:
            raise ValueError(f"SchedulerConfig.from_dict: {lost} held an object of the saving process (a callable, a "
                             f"process group), which is not saved; give it again: from_dict(values, {lost[0]}=...) "
                             f"or from_pretrained(path, {lost[0]}=...)")
        return cls.from_options(None, **values)


# ---------------------------------------------------------------------------------------------- helpers
_MAIN = frozenset(f.name for f in dataclasses.fields(SchedulerConfig) if f.init)
_EXPERIMENTAL = frozenset(f.name for f in dataclasses.fields(ExperimentalOptions))
_SHORTHAND = _MAIN | _EXPERIMENTAL | {"frozen_state"}


def _frozen_state_of(config) -> Optional[str]:
    """SchedulerConfig.frozen_state: optimizer_state in frozen_state's names ("auto", "compress_all",
    "compress", "offload" or None)."""
    return to_frozen_state(config.optimizer_state)


SchedulerConfig.frozen_state = property(_frozen_state_of)   # after the dataclass took the InitVar's default


def _frozen_state_value(value) -> str:
    """optimizer_state's name of a frozen_state value, refused in the config's error style."""
    try:
        return from_frozen_state(value)
    except ValueError:
        raise _error(_C, "frozen_state", f"one of {FROZEN_STATES} (optimizer_state's older names)", value,
                     _did_you_mean(value, FROZEN_STATES) or f"or optimizer_state, one of {OPTIMIZER_STATES}") from None


def _take_frozen_state(config, frozen_state) -> None:
    """SchedulerConfig(frozen_state=...): the value read as optimizer_state (both given: they must agree)."""
    if isinstance(frozen_state, str) and frozen_state == _NO_FROZEN_STATE:
        return
    mode = _frozen_state_value(frozen_state)
    if config.optimizer_state not in (DEFAULT_OPTIMIZER_STATE, mode):
        raise ValueError(f"SchedulerConfig: optimizer_state={config.optimizer_state!r} and frozen_state="
                         f"{frozen_state!r} (its older name) disagree; give optimizer_state alone (cfg.replace(...) "
                         "changes a config)")
    object.__setattr__(config, "optimizer_state", mode)


def _optimizer_state_from_dict(values: dict) -> None:
    """A saved dict's frozen_state read as optimizer_state; neither saved: the file was written before slimfit
    held any optimizer state, so a resumed run holds none ("full")."""
    if "frozen_state" in values:
        mode = _frozen_state_value(values.pop("frozen_state"))
        if values.setdefault("optimizer_state", mode) != mode:
            raise ValueError(f"SchedulerConfig.from_dict: optimizer_state={values['optimizer_state']!r} and "
                             f"frozen_state (its older name, {to_frozen_state(mode)!r}) disagree")
    values.setdefault("optimizer_state", "full")


def _route(base: SchedulerConfig, options: dict) -> dict:
    """Keyword shorthand -> dataclasses.replace() changes: experimental names go into ``experimental``;
    ``score`` goes where its value belongs (an experimental score into ``experimental.score``)."""
    unknown = [k for k in options if k not in _SHORTHAND]
    if unknown:
        hints = [f"{k!r}" + (f" (did you mean {m!r}?)" if (m := _closest(k, _SHORTHAND)) else "") for k in unknown]
        raise TypeError(f"unknown scheduler option(s) {', '.join(hints)}; the options are the fields of "
                        f"SchedulerConfig: {', '.join(sorted(_SHORTHAND))}")
    main = {k: v for k, v in options.items() if k in _MAIN}
    if "frozen_state" in options:   # optimizer_state's older name
        mode = _frozen_state_value(options["frozen_state"])
        if main.setdefault("optimizer_state", mode) != mode:
            raise ValueError(f"SchedulerConfig: optimizer_state={main['optimizer_state']!r} and frozen_state="
                             f"{options['frozen_state']!r} (its older name) disagree; give optimizer_state alone")
    part = {k: v for k, v in options.items() if k in _EXPERIMENTAL and k not in _MAIN}
    score = main.get("score")
    if isinstance(score, str) and score in EXPERIMENTAL_SCORES:
        part["score"], main["score"] = score, "relative"
    elif "score" in main and "experimental" not in main:
        part["score"] = None          # a main score replaces the base's experimental one
    if part:
        experimental = main.get("experimental", base.experimental)
        _experimental(base, experimental)
        main["experimental"] = dataclasses.replace(experimental, **part)
    return main


# Fields that moved from ExperimentalOptions to the main surface: a saved nested dict may hold them there.
_PROMOTED = ("update_scale", "warmup_steps")


def _experimental_from_dict(values: Mapping) -> ExperimentalOptions:
    values = {k: v for k, v in values.items() if k not in _PROMOTED}
    unknown = sorted(set(values) - _EXPERIMENTAL)
    if unknown:
        raise ValueError(f"SchedulerConfig.from_dict: unknown experimental field(s) {unknown}; known: "
                         f"{sorted(_EXPERIMENTAL)}")
    return ExperimentalOptions(**values)


def _config_hint(config) -> str:
    if isinstance(config, str):
        return "; pass the freeze rate as a number (e.g. 0.7), or freeze_rate=0.7"
    if isinstance(config, Mapping):
        return "; unpack a dict of options (ILSScheduler(model, **options)) or use SchedulerConfig.from_dict"
    if type(config).__name__ == "SlimFitConfig":
        return "; a SlimFitConfig configures slimfit.patch, not the scheduler"
    return ""


def _saveable(value):
    if isinstance(value, tuple):
        return [v[0] if isinstance(v, tuple) else v for v in value]
    if isinstance(value, Mapping):
        return dict(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return NOT_SAVED


def _differs(a, b) -> bool:
    try:
        return bool(a != b)
    except RuntimeError:   # tensors inside (layer pairs)
        return True


def _repr_value(value) -> str:
    if isinstance(value, Mapping):
        return f"<{len(value)} layers>"
    if isinstance(value, tuple):
        return repr(tuple(v[0] if isinstance(v, tuple) else v for v in value))
    return repr(value)
