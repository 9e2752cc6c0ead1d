"""ILSScheduler: SlimFit's inter-layer scheduling (which layers are frozen each step).

Plain loop::

    sched = ILSScheduler(model, freeze_rate=0.7, optimizer=opt)
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()          # after optimizer.step(): score, then choose next step's frozen set

What ``step()`` does, in order:
 1. scores the layers trained in the step that just ended against their snapshot (one batched
    reduction, one host transfer; see ``scores.py``); frozen layers keep their stale scores;
 2. under torch.distributed, rank 0's scores are broadcast (one collective; ``ddp.py``);
 3. chooses the next trained set (``selection.py``): never-trained layers first (round
    robin from seeded random initial scores), then the highest scores; ``round(rate * L)``
    layers are frozen, or more if a memory budget needs it (``budget.py``);
 4. flips ``requires_grad`` (and drops ``.grad`` of newly frozen layers);
 5. drops the snapshots. With an attached torch Adam/AdamW (the default ``step_chunk_numel``) the step
    is taken a piece at a time (slimfit.optim.ChunkedStep) and the trained layers are scored inside it,
    piece by piece (in_step.py): no snapshot at all. With another attached optimizer they are taken right
    before the weights move (the optimizer's step pre-hook; with slimfit.optim.step_in_backward, right
    before each parameter's own step), so they are not alive through forward and backward, where the
    step's peak usually is; without one (or with sharded parameters) they are taken here. Only the layers
    that train are snapshotted (frozen layers do not move): (1 - rate) of the weights, not a full copy.

The only contract with the rest of slimfit is ``param.requires_grad``.
"""
from __future__ import annotations

import contextlib
import gc
import math
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from slimfit._optimizer_state import from_frozen_state, holds_any

from . import budget as _budget
from .candidates import (
    KINDS,
    TASK_HEAD,
    candidate_kinds,
    default_task_head,
    drop_always_trained,
    find_candidates,
    is_causal_lm,
    keep_kinds,
    resolve_layers,
    task_head_names,
    unwrap_model,
)
from .config import AUTO_WARMUP, DECODER_WARMUP_STEPS, EVEN_SHARE, RUNTIME_FIELDS, SchedulerConfig
from .ddp import DistSync, check_not_deepspeed, check_parallel_wrappers, names_digest, resolve_group
from .embeddings import check_embeddings, held_embeddings
from .in_step import InStepScores
from .optim import FrozenGradGuard, check_optimizer_coverage, unwrap_optimizer, weak_method
from .scores import BlockSums, compute_scores
from .selection import choose_trained, num_frozen, starved_first, training_order
from .sharded import is_sharded, local_tensor, process_group_ready, sharded_scores
from .state import STATE_VERSION, check_state, config_changes

__all__ = ["ILSScheduler"]

# Initial scores: seeded uniform in [INIT_LO, 2 * INIT_LO), far above any real score. The
# explicit "never trained" flag already puts those layers first; the size mirrors SlimFit.
INIT_LO = 1e6
# step() calls in a row without an optimizer step before the scheduler warns that it is stuck.
IDLE_WARNING_CALLS = 10


def _candidate_layers(model_or_named_params, cfg: SchedulerConfig) -> tuple[list, Optional[nn.Module]]:
    """(the candidate layers as (name, parameter) pairs, the model or None for a parameter list): the
    default candidates, or ``cfg.layers`` checked against the model."""
    if isinstance(model_or_named_params, nn.Module):
        base = unwrap_model(model_or_named_params)
        named = resolve_layers(base, cfg.layers) if cfg.layers is not None else find_candidates(base)
        check_parallel_wrappers(model_or_named_params, [p for _, p in base.named_parameters()])
        return named, model_or_named_params
    if cfg.layers is not None:
        raise TypeError("layers= is only accepted together with a model: ILSScheduler(model, layers=[...])")
    if isinstance(model_or_named_params, (torch.Tensor, str)) or not isinstance(model_or_named_params, Iterable):
        raise TypeError(f"expected a module or (name, parameter) pairs, e.g. model.named_parameters(); got "
                        f"{type(model_or_named_params).__name__}")
    named = find_candidates(model_or_named_params)
    check_parallel_wrappers(None, [p for _, p in named])
    return named, None


def resolve_warmup_steps(value, module: Optional[nn.Module]) -> int:
    """SchedulerConfig.warmup_steps against the model: "auto" is DECODER_WARMUP_STEPS for a causal LM and 0 for
    any other model, or when only parameters were given (no model to tell)."""
    if not (isinstance(value, str) and value == AUTO_WARMUP):
        return int(value)
    return DECODER_WARMUP_STEPS if module is not None and is_causal_lm(module) else 0


def _scheduled_layers(candidates: list, module: Optional[nn.Module],
                      cfg: SchedulerConfig) -> tuple[list, tuple, tuple]:
    """(the scheduled (name, parameter) pairs, the kinds scheduled, the names that train every step):
    the candidates of ``cfg.kinds``, less ``always_train`` (None: a task model's fresh head)."""
    named, kinds = candidates, cfg.kinds
    if kinds != KINDS:
        named = keep_kinds(named, candidate_kinds(module, named), kinds)
    always = cfg.always_train
    if always is None:  # default: a Hugging Face task model's fresh head trains every step
        always = default_task_head(module, named) if module is not None and cfg.layers is None else ()
    elif always == TASK_HEAD:
        if module is None:
            raise TypeError('always_train="task_head" needs the model, not a parameter list')
        always = task_head_names(unwrap_model(module))
    named = drop_always_trained(named, always)
    return named, kinds, tuple(always)


def _layer_bytes(cfg: SchedulerConfig, named: list, candidates: list) -> tuple[Optional[torch.Tensor], float]:
    """(activation bytes of each scheduled layer or None, the base bytes): the candidates that train every
    step cost their bytes every step, so they join ``cfg.base_bytes``. Raises when no layer fits a budget."""
    if cfg.activation_bytes is None:
        return None, cfg.base_bytes
    scheduled = {id(p) for _, p in named}
    bytes_, always = _budget.resolve_activation_bytes(
        cfg.activation_bytes, named, [(n, p) for n, p in candidates if id(p) not in scheduled])
    base = cfg.base_bytes + always
    if cfg.budget_bytes is not None:
        _budget.check_budget(bytes_, cfg.budget_bytes, base, [n for n, _ in named])
    return bytes_, base


# One live scheduler per optimizer and per parameter. A second one on the same optimizer hooks the same step (a
# second chunked step finds no gradient left, so its layers score 0; two holders hold the same state); on the
# same parameters it flips the same requires_grad. Both are refused, naming the first.
_PARAM_OWNERS = WeakIdKeyDictionary()                      # parameter -> weakref to its scheduler
_OPTIMIZER_OWNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # optimizer -> _Attached


class _Attached:
    """The scheduler attached to an optimizer (weakly) and what it hooked there beyond its weak guard: the
    chunked step and the held state live as long as the optimizer, so those of a scheduler dropped without
    close() are taken off by the next scheduler attached to it."""

    def __init__(self, scheduler: "ILSScheduler"):
        self.ref = weakref.ref(scheduler)
        self.hooked: list = []


def _live(ref) -> "Optional[ILSScheduler]":
    """The scheduler behind ``ref`` while it schedules (alive, built and not closed), else None."""
    scheduler = ref() if ref is not None else None
    return scheduler if scheduler is not None and not getattr(scheduler, "_closed", True) else None


def _left_frozen(module) -> list:
    """Names of ``module``'s parameters left frozen by a scheduler dropped without close()."""
    names = []
    for name, p in unwrap_model(module).named_parameters():
        ref = _PARAM_OWNERS.get(p)
        if ref is not None and ref() is None and not p.requires_grad:
            names.append(name)
    return names


def _warn_left_frozen(module) -> None:
    """Warn of parameters a dropped scheduler left frozen: they are no candidates (only trainable ones are)."""
    left = _left_frozen(module) if module is not None else []
    if left:
        warnings.warn(f"ILSScheduler: {len(left)} parameters ({', '.join(left[:4])}{', ...' if len(left) > 4 else ''}) "
                      "were left frozen by an ILSScheduler dropped without close(), so this one does not schedule "
                      "them. Call close() on a scheduler you stop using; to schedule them, set requires_grad_(True) "
                      "on them before building this one", stacklevel=3)


def _owned(scheduler: "ILSScheduler") -> list:
    """(name, parameter) of what the scheduler owns: its scheduled layers and the table it holds frozen."""
    return list(zip(scheduler.names, scheduler.params)) + scheduler.held_frozen


def _claim(scheduler: "ILSScheduler") -> None:
    """When ``scheduler`` starts (its first frozen set applied): ValueError if another live one schedules some
    of its layers, else it is recorded as theirs. A scheduler built and never started (to read its names or
    first decision) claims nothing."""
    _check_sole_owner(scheduler, None)
    for _, p in _owned(scheduler):
        _PARAM_OWNERS[p] = weakref.ref(scheduler)
    scheduler._claimed = True


def _release(scheduler: "ILSScheduler") -> None:
    """Forget ``scheduler`` as the owner of its layers and optimizer (at close())."""
    for _, p in _owned(scheduler):
        ref = _PARAM_OWNERS.get(p)
        if ref is not None and ref() is scheduler:
            del _PARAM_OWNERS[p]
    optimizer = scheduler._attached_to() if scheduler._attached_to is not None else None
    if optimizer is not None:
        _release_optimizer(scheduler, optimizer)


def _release_optimizer(scheduler: "ILSScheduler", optimizer) -> None:
    """Forget ``scheduler`` as the one attached to ``optimizer`` (closed, or attached to another)."""
    entry = _OPTIMIZER_OWNERS.get(optimizer)
    if entry is not None and entry.ref() is scheduler:
        del _OPTIMIZER_OWNERS[optimizer]


def _described(scheduler: "ILSScheduler") -> str:
    names = ", ".join(scheduler.names[:4]) + (", ..." if scheduler.num_layers > 4 else "")
    return f"{scheduler!r} at {id(scheduler):#x}, which schedules {names}"


def _other_owners(scheduler: "ILSScheduler", optimizer) -> tuple:
    """(the live scheduler attached to ``optimizer`` other than this one, this one's layers another live
    scheduler schedules with it); a dropped scheduler caught in a reference cycle is collected first."""
    for attempt in range(2):
        entry = _OPTIMIZER_OWNERS.get(optimizer) if optimizer is not None else None
        on_optimizer = _live(entry.ref if entry is not None else None)
        on_optimizer = None if on_optimizer is scheduler else on_optimizer
        shared, first = [], None
        for name, p in _owned(scheduler):
            owner = _live(_PARAM_OWNERS.get(p))
            if owner is not None and owner is not scheduler:
                shared.append(name)
                first = first or owner
        if (on_optimizer is None and not shared) or attempt:
            return on_optimizer, shared, first
        gc.collect()


def _saved_options(saved):
    """A state's saved options with optimizer_state's older name (frozen_state) read as it, so that a change
    of it is reported too."""
    if not isinstance(saved, dict) or "frozen_state" not in saved or "optimizer_state" in saved:
        return saved
    try:
        mode = from_frozen_state(saved["frozen_state"])
    except ValueError:
        return saved
    return {**{k: v for k, v in saved.items() if k != "frozen_state"}, "optimizer_state": mode}


def _check_sole_owner(scheduler: "ILSScheduler", optimizer) -> None:
    """ValueError when another live ILSScheduler schedules some of these layers or is attached to
    ``optimizer`` (an unwrapped torch optimizer or None): it names that scheduler and the fix."""
    on_optimizer, shared, first = _other_owners(scheduler, optimizer)
    if shared:
        raise ValueError(
            f"ILSScheduler: {len(shared)} of these layers ({', '.join(shared[:4])}{', ...' if len(shared) > 4 else ''})"
            f" are scheduled already by {_described(first)}; two schedulers would flip the same requires_grad. "
            "Call close() on that one first (it unfreezes its layers and takes its hooks off the optimizer), or "
            "give each scheduler other layers (layers=[...] or (name, parameter) pairs)")
    if on_optimizer is not None:
        raise ValueError(
            f"ILSScheduler: this optimizer is attached already to {_described(on_optimizer)}; two schedulers "
            "on one optimizer hook the same step (the second's chunked step finds no gradient left, its layers "
            "would score 0). Call close() on that one first, or schedule both layer sets with one ILSScheduler, "
            "or build this one with optimizer=None (it then hooks nothing on the optimizer)")


def _take_over(scheduler: "ILSScheduler", optimizer) -> _Attached:
    """Record ``scheduler`` as the one attached to ``optimizer``; what a scheduler dropped there without
    close() left hooked is taken off first (a warning says so)."""
    entry = _OPTIMIZER_OWNERS.get(optimizer)
    if entry is not None and entry.ref() is None and entry.hooked:
        warnings.warn("ILSScheduler: the scheduler attached to this optimizer before was dropped without close(); "
                      "its chunked step and held optimizer state are taken off it now. Call close() on a "
                      "scheduler you stop using", stacklevel=4)
        for hooked in entry.hooked:
            hooked.remove()
    entry = _OPTIMIZER_OWNERS[optimizer] = _Attached(scheduler)
    return entry


class _ApplyOnFirstForward:
    """The model's forward pre-hook that applies a scheduler's first frozen set. It holds the
    scheduler weakly, so a scheduler dropped before training (built only to read its decision)
    freezes nothing later, and it pickles as a no-op (a pickled model carries no scheduler)."""

    def __init__(self, scheduler: "ILSScheduler"):
        self._ref = weakref.ref(scheduler)

    def __call__(self, module, args):
        scheduler = self._ref() if self._ref is not None else None
        if scheduler is not None and scheduler._pending and not scheduler._closed:
            scheduler.apply()

    def __getstate__(self):
        return {"_ref": None}


class ILSScheduler:
    """Freeze the ``round(freeze_rate * L)`` scheduled layers (by default the weight matrices) whose
    weights moved least, every optimizer step.

    Args:
        model_or_named_params: an ``nn.Module`` (a DDP wrapper is fine and checked), or
            ``(name, parameter)`` pairs such as ``model.named_parameters()``.
        config: a :class:`SchedulerConfig` (every option, validated once), or a number: the freeze
            rate (``ILSScheduler(model, 0.9)`` is ``ILSScheduler(model, freeze_rate=0.9)``). None: the
            defaults.
        optimizer: attach now (see ``attach_optimizer``).
        **options: fields of SchedulerConfig by name, a shorthand; experimental ones too
            (``frozen_update="momentum"``, ``score="absolute"``). Given with ``config`` they change those
            fields of it (merged: ``config.replace(**options)``). An unknown name is a TypeError that
            lists the valid ones.

    What each option does: :class:`SchedulerConfig`. ``self.config`` holds the options in force
    (``set_freeze_rate`` replaces it); ``scheduled_kinds`` and ``always_train`` are those options
    resolved against the model, ``base_bytes`` the base with the unscheduled candidates' bytes added.

    One live scheduler per optimizer and per layer: a second one attached to the same optimizer, or starting
    over layers another schedules, is a ValueError that names the first (``close()`` it first). A scheduler
    built and never started (to read its names or first decision) claims nothing.
    """

    def __init__(self, model_or_named_params: Union[nn.Module, Iterable], config=None, optimizer=None,
                 **options):
        if isinstance(optimizer, str):
            raise TypeError(f"ILSScheduler's third argument is the optimizer, got str {optimizer!r}; the options "
                            f"are keywords (score={optimizer!r}) or a SchedulerConfig")
        if optimizer is not None:
            unwrap_optimizer(optimizer)   # a wrong type fails here, before the model is touched
        self.config = SchedulerConfig.from_options(config, **options)
        candidates, module = _candidate_layers(model_or_named_params, self.config)
        # the input embedding held frozen for the run (embeddings.py): no candidate, no gradient, no state
        freeze = check_embeddings(self.config.embeddings, module) == "freeze"
        self.held_frozen = held_embeddings(module, candidates) if freeze else []
        held = {id(p) for _, p in self.held_frozen}
        candidates = [(n, p) for n, p in candidates if id(p) not in held]
        named, self.scheduled_kinds, self.always_train = _scheduled_layers(candidates, module, self.config)
        self.warmup_steps = resolve_warmup_steps(self.config.warmup_steps, module)
        self.names: list[str] = [n for n, _ in named]
        self.params: list[nn.Parameter] = [p for _, p in named]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        if optimizer is not None:   # it starts now: refused before the model is touched
            _check_sole_owner(self, unwrap_optimizer(optimizer))
        _warn_left_frozen(module)
        self._bytes, self.base_bytes = _layer_bytes(self.config, named, candidates)
        self._init_state()
        self._decide(first=True)
        self._snapshot()
        # The first frozen set is applied when training starts (the model's first forward,
        # attach_optimizer or step()), not now: an optimizer or DDP wrapper built after the
        # scheduler from `p.requires_grad` must still see every scheduled parameter, or the
        # layers frozen now would never train (Trainer builds its optimizer that way).
        self._pending = True
        self._forward_hook = None
        self._attached_to = None   # weakref to the optimizer attached (the one-scheduler-per-optimizer record)
        self._claimed = False      # its layers recorded as its own (when it starts: _claim)
        if optimizer is not None:
            self.attach_optimizer(optimizer)   # training starts now: applies the frozen set
        elif module is not None:
            self._forward_hook = unwrap_model(module).register_forward_pre_hook(_ApplyOnFirstForward(self))
        else:
            self.apply()  # no model to watch: a parameter list is frozen at once

    def _init_state(self) -> None:
        """The per-layer state before the first decision; under torch.distributed, rank 0's initial
        scores (after checking that every rank has the same layers)."""
        L = self.num_layers
        gen = torch.Generator().manual_seed(self.config.seed)
        init = INIT_LO * (1.0 + torch.rand(L, generator=gen, dtype=torch.float64))
        self._dist: Optional[DistSync] = None
        # The seed of the run: rank 0's under torch.distributed (what draws from it must agree between ranks).
        self.run_seed = self.config.seed
        active, group = resolve_group(self.config.distributed, self.config.process_group)
        if active:
            self._dist = DistSync(group)
            init, self.run_seed = self._dist.init_check(
                names_digest(self.names, [tuple(p.shape) for p in self.params]), init, self.config.seed)
        self._scores = init
        # FSDP2 (fully_shard): parameters are DTensors; scores come from per-shard sums (sharded.py).
        self._sharded = any(is_sharded(p) for p in self.params)
        self._group = group
        if self._sharded and self._dist is None and not process_group_ready():   # world size 1 included
            raise RuntimeError("sharded (DTensor) parameters need an initialised torch.distributed process group")
        self._seen = torch.zeros(L, dtype=torch.bool)      # has a real score
        self._trained = torch.zeros(L, dtype=torch.bool)   # current decision: trains this step
        self._age = torch.zeros(L, dtype=torch.long)       # steps spent in the current state
        self._train_count = torch.zeros(L, dtype=torch.long)  # steps each layer trained so far
        self._zero_flags = [False] * L                    # W_old had zeros: zero-aware relative score
        self._step = 0
        self.skipped_steps = 0
        self._snap: dict[int, torch.Tensor] = {}
        self._sums: dict = {}        # layer -> scores.BlockSums summed inside the optimizer step (in_step.py)
        self._chunked_step = None    # config.step_chunk_numel's slimfit.optim.ChunkedStep once attached
        self._in_step = InStepScores(self)
        self._guard: Optional[FrozenGradGuard] = None
        self._frozen_state = None    # config.optimizer_state's holder (slimfit.optim.FrozenState) once attached
        self._opt_steps_seen = 0
        self._closed = False
        self._idle_calls = 0  # step() calls in a row that followed no optimizer step
        self._warned_idle = False
        self._frozen_set_hooks: OrderedDict = OrderedDict()  # register_frozen_set_hook

    # ------------------------------------------------------------------ public API
    @property
    def num_layers(self) -> int:
        return len(self.params)

    @property
    def num_frozen(self) -> int:
        return int((~self._trained).sum())

    @property
    def freeze_rate(self) -> float:
        """The target freeze rate (``config.freeze_rate``; ``set_freeze_rate`` changes it)."""
        return self.config.freeze_rate

    @property
    def effective_rate(self) -> float:
        """Fraction of candidate layers frozen right now (budget mode may exceed freeze_rate)."""
        return self.num_frozen / self.num_layers

    @property
    def embeddings(self) -> str:
        """config.embeddings: "train", or "freeze" (held_frozen lists the table held)."""
        return self.config.embeddings

    @property
    def chunked_step(self):
        """The slimfit.optim.ChunkedStep attached to the optimizer (config.step_chunk_numel), or None."""
        return self._chunked_step

    @property
    def state_holder(self):
        """The slimfit.optim.FrozenState that holds the moments as config.optimizer_state says, or None."""
        return self._frozen_state

    @property
    def step_observer(self) -> InStepScores:
        """What a chunked optimizer step reports to, so the trained layers are scored inside it (in_step.py):
        ``wants(p)``, ``lr_factor(p)``, ``piece(p, start, old, new)``, ``left_to_optimizer(params)``."""
        return self._in_step

    @property
    def step_count(self) -> int:
        return self._step

    @property
    def closed(self) -> bool:
        """True after ``close()``: every layer unfrozen, no more steps."""
        return self._closed

    def frozen_names(self) -> list[str]:
        return [n for n, t in zip(self.names, self._trained.tolist()) if not t]

    def trained_names(self) -> list[str]:
        return [n for n, t in zip(self.names, self._trained.tolist()) if t]

    def train_counts(self) -> dict[str, int]:
        """Steps each layer has trained in so far (what min_train_share works from)."""
        return dict(zip(self.names, self._train_count.tolist()))

    def layer_scores(self) -> dict[str, float]:
        """Current score of every layer (stale for frozen ones; initial random for never-trained)."""
        return dict(zip(self.names, self._scores.tolist()))

    def trained_bytes(self) -> Optional[float]:
        """Estimated activation bytes of the layers training now (None without estimates)."""
        if self._bytes is None:
            return None
        return float(self._bytes[self._trained].sum())

    def set_freeze_rate(self, rate: float) -> None:
        """Change the rate (validated with the other options, as ``config.replace(freeze_rate=rate)``);
        it takes effect at the next ``step()``."""
        self.config = self.config.replace(freeze_rate=rate)

    def apply(self) -> None:
        """Apply the current frozen set to ``requires_grad`` now. Done by itself at the model's
        first forward, at ``attach_optimizer`` and at ``step()``; call it to freeze earlier. ValueError when
        another live scheduler schedules some of the same layers (close() that one first)."""
        if not self._claimed:
            _claim(self)
        self._pending = False
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        for _, p in self.held_frozen:   # embeddings="freeze": frozen from the start to close()
            p.requires_grad_(False)
            p.grad = None
        self._apply()

    def attach_optimizer(self, optimizer) -> FrozenGradGuard:
        """Hook ``optimizer`` so frozen parameters have ``grad is None`` at every update (or,
        with the experimental ``frozen_update="momentum"``, a zero gradient when they have optimizer
        state), and so ``step()`` can skip iterations where the optimizer did not step.

        Raises ValueError when the optimizer holds none of the scheduled parameters, and warns
        when it misses some: those layers could never train. ValueError too when another live scheduler
        is attached to it (one scheduler per optimizer: close() the other first)."""
        check_not_deepspeed(optimizer, unwrap_optimizer(optimizer))
        check_optimizer_coverage(optimizer, self.names, self.params)
        opt = unwrap_optimizer(optimizer)
        _check_sole_owner(self, opt)
        previous = self._attached_to() if self._attached_to is not None else None
        if previous is not None and previous is not opt:
            _release_optimizer(self, previous)
        entry = _take_over(self, opt)
        self._attached_to = weakref.ref(opt)
        if self._guard is not None:
            self._guard.remove()
        self._guard = FrozenGradGuard(optimizer, weak_method(self._frozen_params, default=[]),
                                      frozen_update=self.config.experimental.frozen_update,
                                      before_update=weak_method(self._snapshot_before_update))
        self._opt_steps_seen = self._guard.steps
        self._idle_calls = 0
        self._attach_optimizer_side(optimizer)
        if self.snapshots_on_update:
            self._snap.clear()   # taken right before the weights move from now on
        entry.hooked = [h for h in (self._chunked_step, self._frozen_state) if h is not None]
        if self._pending:
            self.apply()
        return self._guard

    def _attach_optimizer_side(self, optimizer) -> None:
        """config.step_chunk_numel and config.optimizer_state: the optimizer's step a piece at a time with the
        trained layers scored in it (in_step.py; FSDP2's sharded parameters: each rank sums its own pieces,
        added up over the ranks, sharded.py), and the moments held as optimizer_state says. Both are slimfit.optim's
        (slimfit/optim/attach.py), imported here, when the config asks for either: importing the scheduler
        loads no kernel code."""
        for attached in (self._chunked_step, self._frozen_state):
            if attached is not None:
                attached.remove()
        self._chunked_step = self._frozen_state = None
        chunked = self.config.step_chunk_numel is not None
        momentum = self.config.experimental.frozen_update != "none"
        if not chunked and not holds_any(self.config.optimizer_state, momentum):
            return
        from slimfit.optim.attach import attach_optimizer_side

        self._chunked_step, self._frozen_state = attach_optimizer_side(self, optimizer, chunked=chunked)

    def register_frozen_set_hook(self, hook) -> RemovableHandle:
        """Call ``hook(frozen, trained)`` (two lists of parameters) every time a frozen set is applied to
        ``requires_grad``: the first one when training starts, then in every ``step()`` right after the next
        step's set is chosen, after ``load_state_dict``, and at ``close()`` (nothing frozen). Called at once
        when a set is applied already. For code that keeps per-layer state in step with the schedule (e.g.
        slimfit.optim's compressed or offloaded optimizer state of frozen layers); the scheduler knows nothing
        of what the hook does. Returns a handle whose ``remove()`` unregisters it."""
        if not callable(hook):
            raise TypeError(f"register_frozen_set_hook: hook must be a callable (frozen, trained) -> None, "
                            f"got {type(hook).__name__}")
        handle = RemovableHandle(self._frozen_set_hooks)
        self._frozen_set_hooks[handle.id] = hook
        if not self._pending and not self._closed:
            hook(*self._frozen_and_trained())
        return handle

    def _frozen_and_trained(self) -> tuple[list, list]:
        flags = self._trained.tolist()
        return ([p for p, t in zip(self.params, flags) if not t], [p for p, t in zip(self.params, flags) if t])

    def _run_frozen_set_hooks(self) -> None:
        if self._frozen_set_hooks:
            frozen, trained = self._frozen_and_trained()
            for hook in list(self._frozen_set_hooks.values()):
                hook(frozen, trained)

    @torch.no_grad()
    def step(self) -> None:
        """Call once per optimizer step, after ``optimizer.step()``.

        With an attached optimizer, a call that follows no optimizer step (AMP skipped it on
        inf/NaN, or ``step()`` was called per micro-batch under gradient accumulation) changes
        nothing and counts in ``skipped_steps``.
        """
        if self._closed:
            raise RuntimeError("this ILSScheduler was closed")
        if self._pending:
            self.apply()
        if not self._optimizer_stepped():
            return
        idx = self._trained.nonzero().flatten().tolist()
        in_pass = self._score_trained(idx, self._update_factors(idx))
        self._train_count += self._trained.long()
        self._age += 1
        self._step += 1
        self._decide(first=False)
        self._apply()
        self._sums.clear()
        if self.snapshots_on_update:
            self._snap.clear()
        else:
            self._snapshot(refresh=not in_pass)
        after = self.config.release_state_after
        if after is not None and self._guard is not None:
            long_frozen = (~self._trained) & (self._age >= after)
            self._guard.release_state([self.params[i] for i in long_frozen.nonzero().flatten().tolist()])

    def state_dict(self, include_snapshots: bool = False) -> dict[str, Any]:
        """Everything the decisions depend on. Snapshots (weights at the last ``step()``) are
        left out by default: ``load_state_dict`` retakes them from the model, which is exact
        when the checkpoint was written after ``step()`` and the model weights are loaded first.
        ``include_snapshots=True`` (a checkpoint written between ``optimizer.step()`` and ``step()``) adds
        what this ``step()`` scores against: the snapshots, or the score sums made inside a chunked step."""
        sd = {
            "version": STATE_VERSION,
            "names": list(self.names),
            "shapes": [tuple(p.shape) for p in self.params],
            "config": self._config(),
            "scores": self._scores.clone(),
            "seen": self._seen.clone(),
            "trained": self._trained.clone(),
            "age": self._age.clone(),
            "train_count": self._train_count.clone(),
            "zero_flags": list(self._zero_flags),
            "step": self._step,
            "skipped_steps": self.skipped_steps,
        }
        if include_snapshots:
            sd["snapshots"] = {self.names[i]: t.detach().cpu().clone() for i, t in self._snap.items()}
            if self._sums:   # scored inside the optimizer step: the sums so far, not snapshots
                sd["in_step_sums"] = {self.names[i]: sums.sums() for i, sums in self._sums.items()}
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; load the model weights first. Applies the restored frozen set
        at once. The whole state is checked first (``state.check_state``): a state that does not fit
        raises ValueError naming what is wrong, and the scheduler is left as it was."""
        shapes = [tuple(local_tensor(p).shape) for p in self.params]
        new = check_state(state, self.names, [tuple(p.shape) for p in self.params], shapes, self.always_train)
        diff = config_changes(_saved_options(state.get("config")), self._config())
        if diff:
            warnings.warn(f"ILSScheduler.load_state_dict: options differ from the saved run {diff}; "
                          "decisions will follow this scheduler's options", stacklevel=2)
        self._scores, self._seen, self._trained = new["scores"], new["seen"], new["trained"]
        self._age, self._train_count = new["age"], new["train_count"]
        self._zero_flags, self._step, self.skipped_steps = new["zero_flags"], new["step"], new["skipped_steps"]
        self.apply()
        snaps = new["snapshots"]
        self._snap = {}
        index = {n: i for i, n in enumerate(self.names)}
        self._sums = {index[n]: BlockSums(self.config.effective_score, self.params[index[n]].dtype).restore(v)
                      for n, v in new["in_step_sums"].items()}
        if snaps:
            for i in self._trained.nonzero().flatten().tolist():
                p = self.params[i]
                self._snap[i] = snaps[self.names[i]].to(device=p.device, dtype=p.dtype).clone()
        if not self.snapshots_on_update:
            self._snapshot(refresh=not snaps)
        # else: saved mid-step (between optimizer.step() and step()), the loaded snapshots are the ones
        # this step()'s scores need; saved between steps, there are none until the next update
        if self._guard is not None:
            self._opt_steps_seen = self._guard.steps

    def summary(self, top: int = 5) -> str:
        """A few lines on the state: frozen count and rate, options of note, lowest and highest scores."""
        L, cfg = self.num_layers, self.config
        lines = [
            f"ILSScheduler: step {self._step}, {self.num_frozen}/{L} layers frozen "
            f"(rate {self.effective_rate:.3f}, target {cfg.freeze_rate}), score={cfg.effective_score}"
            + (", memory-aware" if cfg.memory_aware else "")
            + (f", budget {cfg.budget_bytes / 2**20:.1f} MiB" if cfg.budget_bytes is not None else ""),
            f"  layers with a real score: {int(self._seen.sum())}/{L}; skipped steps: {self.skipped_steps}",
        ]
        tb = self.trained_bytes()
        if tb is not None:
            total = float(self._bytes.sum())
            lines.append(f"  est. activation bytes of trained layers: {tb / 2**20:.2f} MiB of {total / 2**20:.2f} MiB")
        seen = self._seen.nonzero().flatten().tolist()
        if seen:
            seen.sort(key=lambda i: float(self._scores[i]))

            def fmt(i: int) -> str:
                return f"{self.names[i]}={float(self._scores[i]):.3g}{'' if self._trained[i] else ' (frozen)'}"

            lines.append("  lowest:  " + ", ".join(fmt(i) for i in seen[:top]))
            lines.append("  highest: " + ", ".join(fmt(i) for i in seen[::-1][:top]))
        lines.append("  training: " + ", ".join(self.trained_names()[: max(top, 8)])
                     + (" ..." if len(self.trained_names()) > max(top, 8) else ""))
        if self._guard is not None:
            lines.append("  optimizer: " + self._optimizer_line())
        return "\n".join(lines)

    def _optimizer_line(self) -> str:
        """What is attached to the optimizer, as it is (not as the config asked)."""
        if self._chunked_step is not None:
            step = f"chunked step ({self._chunked_step.chunk_numel:,} elements a call), layers scored inside it"
        else:
            step = "its own step, layers scored against weight snapshots"
        held = self._frozen_state
        if held is None:
            state = "state as the optimizer keeps it"
        else:
            how = {"compress": "8-bit", "offload": "in host memory"}.get(held.mode, held.mode)
            state = f"every layer's state {how}" if held.between_steps else f"frozen layers' state {how}"
        return f"{step}; {state}"

    @contextlib.contextmanager
    def every_layer_trainable(self):
        """Inside the block every scheduled layer requires grad; after it, the frozen set in force again
        (gradients, state and decisions untouched). For torch.distributed.checkpoint's ``get_state_dict`` /
        ``set_state_dict`` (and what calls them: accelerate's FSDP checkpoints): they save and load the
        optimizer state of parameters that require grad only, so a layer frozen at that moment would lose its
        moments silently, though it trains again later. Wrap both calls::

            with scheduler.every_layer_trainable():
                model_sd, optim_sd = get_state_dict(model, optimizer)
        """
        flags = [p.requires_grad for p in self.params]
        for p in self.params:
            p.requires_grad_(True)
        try:
            yield self
        finally:
            for p, flag in zip(self.params, flags):
                p.requires_grad_(flag)

    def close(self) -> None:
        """Unfreeze every layer (the embedding held frozen too), remove optimizer hooks, free the snapshots."""
        for _, p in _owned(self):
            p.requires_grad_(True)
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        self._pending = False
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        if self._chunked_step is not None:
            self._chunked_step.remove()
            self._chunked_step = None
        self._snap = {}
        self._sums = {}
        self._trained[:] = True
        self._run_frozen_set_hooks()   # nothing frozen: hooks put back what they held
        if self._frozen_state is not None:
            self._frozen_state.remove()
            self._frozen_state = None
        self._frozen_set_hooks.clear()
        _release(self)
        self._closed = True

    def __repr__(self) -> str:
        return (f"ILSScheduler(layers={self.num_layers}, frozen={self.num_frozen}, freeze_rate={self.freeze_rate}, "
                f"score={self.config.effective_score!r}, step={self._step})")

    def current_rate(self) -> float:
        """The freeze rate in force for the next step (below freeze_rate during the ramp of warmup_steps)."""
        warmup = self.warmup_steps
        if warmup and self._step < warmup:
            start = min(self.config.experimental.warmup_start_rate, self.freeze_rate)
            return start + (self.freeze_rate - start) * self._step / warmup
        return self.freeze_rate

    # ------------------------------------------------------------------ internals
    def _config(self) -> dict[str, Any]:
        """The options a state is saved with, flat (as the keyword shorthand names them): the config less
        the fields bound to this process or model object, with scheduled_kinds and always_train as
        resolved against the model (what the decisions followed)."""
        flat = self.config.to_dict(nested=False)
        out = {k: v for k, v in flat.items() if k != "version" and k not in RUNTIME_FIELDS}
        out["scheduled_kinds"] = list(self.scheduled_kinds)
        out["always_train"] = list(self.always_train)
        return out

    def _optimizer_stepped(self) -> bool:
        """False (and counted in skipped_steps) when an optimizer is attached and has not stepped since
        the last call; warns once when it looks as if another optimizer does the updates."""
        if self._guard is None:
            return True
        if self._guard.steps != self._opt_steps_seen:
            self._opt_steps_seen = self._guard.steps
            self._idle_calls = 0
            return True
        self.skipped_steps += 1
        self._idle_calls += 1
        # Gradients accumulating between calls mean micro-batches (fine); cleared
        # gradients with no step of the attached optimizer mean another optimizer steps.
        cleared = all(p.grad is None for p, t in zip(self.params, self._trained.tolist()) if t)
        if self._idle_calls >= IDLE_WARNING_CALLS and self._guard.steps == 0 and cleared and not self._warned_idle:
            self._warned_idle = True
            warnings.warn(
                f"ILSScheduler.step() was called {IDLE_WARNING_CALLS} times and the attached optimizer has "
                "never stepped, so the frozen set has not changed: attach the optimizer that updates "
                "this model (attach_optimizer), and call step() once per optimizer step", stacklevel=3)
        return False

    def _score_trained(self, idx: list[int], factors: Optional[list[float]]) -> bool:
        """Score the layers ``idx`` that trained in the step that just ended; True when the scoring pass
        also refreshed their snapshots (CPU and sharded layers: while the blocks are in cache)."""
        if not idx:
            return False
        factor_of = dict(zip(idx, factors)) if factors is not None else None   # idx is narrowed below
        if self._sharded:
            return self._score_sharded(idx, factor_of)
        summed = [i for i in idx if i in self._sums]
        if summed:   # scored inside the optimizer step (in_step.py), of the update as stretched there
            it = torch.tensor(summed, dtype=torch.long)
            self._scores[it] = torch.tensor([self._sums[i].value() / self._coming_factor(i) for i in summed],
                                            dtype=torch.float64)
            self._seen[it] = True
            idx = [i for i in idx if i not in self._sums]
            if not idx:
                return False
        missing = [i for i in idx if i not in self._snap]
        if missing:
            if self.snapshots_on_update:
                # a trained layer with no snapshot never reached its update (step_in_backward: no
                # gradient): it did not move, which scores 0 in every score
                it = torch.tensor(missing, dtype=torch.long)
                self._scores[it], self._seen[it] = 0.0, True
            # else the optimizer was detached since the update: no W_old to score against this once
            idx = [i for i in idx if i in self._snap]
            if not idx:
                return False
        flags = [self._zero_flags[i] for i in idx]
        # CPU layers refresh their snapshots in the scoring pass, unless none are kept between steps
        in_pass = not self.snapshots_on_update and all(self.params[i].device.type == "cpu" for i in idx)
        vals = self._local_scores(idx, flags, in_pass)
        for i, f in zip(idx, flags):
            self._zero_flags[i] = f
        it = torch.tensor(idx, dtype=torch.long)
        if factor_of is not None:   # every score is linear in the update: score the unscaled one
            vals = vals.to(torch.float64) / torch.tensor([factor_of[i] for i in idx], dtype=torch.float64)
        self._scores[it] = vals
        self._seen[it] = True
        return in_pass

    def _score_sharded(self, idx: list[int], factor_of: Optional[dict]) -> bool:
        """Score the sharded (FSDP2) layers ``idx``: each rank's partial sums of its shards (summed inside a
        chunked step, or against its snapshot shards), one all-reduce over the ranks (sharded.py); every rank
        takes every layer, so the collective matches whatever each rank took its sums from. True when the
        snapshots were refreshed in the pass (no chunked step: snapshots kept between steps)."""
        in_pass = not self.snapshots_on_update
        parts = [self._sums[i].sums() if i in self._sums else self._snap.get(i) for i in idx]
        vals = sharded_scores(self.config.effective_score, parts, [self.params[i] for i in idx], group=self._group,
                              refresh=in_pass)
        # every score is linear in the update: score the unstretched one (in-step sums: as stretched there)
        factors = [self._coming_factor(i) if i in self._sums else (factor_of or {}).get(i, 1.0) for i in idx]
        it = torch.tensor(idx, dtype=torch.long)
        self._scores[it] = vals.to(torch.float64) / torch.tensor(factors, dtype=torch.float64)
        self._seen[it] = True
        return in_pass

    def _local_scores(self, idx: list[int], flags: list[bool], refresh: bool) -> torch.Tensor:
        return compute_scores(
            self.config.effective_score, [self._snap[i] for i in idx], [self.params[i] for i in idx],
            chunk_numel=self.config.chunk_numel,
            collective=self._dist.broadcast if self._dist is not None else None, zero_flags=flags,
            refresh=refresh)

    @torch.no_grad()
    def _update_factors(self, idx: list[int]) -> Optional[list[float]]:
        """update_scale="share": stretch the update each trained layer just took (weights
        minus snapshot) by its catch-up factor, in place; returns the factors (None: nothing scaled)."""
        if self.config.update_scale == "none" or not idx:
            return None
        factors = [self._coming_factor(i) for i in idx]
        for i, f in zip(idx, factors):
            # summed: stretched already inside a chunked step (in_step.py); no snapshot: the layer did not move
            if f != 1.0 and i not in self._sums and i in self._snap:
                # p + (f - 1) (p - snap) == lerp(p, snap, 1 - f)
                local_tensor(self.params[i]).lerp_(self._snap[i], 1.0 - f)
        return factors

    def _coming_factor(self, i: int) -> float:
        """The factor by which layer ``i``'s update of the step under way (trained now) is stretched: with
        update_scale="share" steps so far / steps it trained, capped at layers / trained layers; "sqrt_share"
        its square root; 1.0 otherwise."""
        if self.config.update_scale == "none" or not bool(self._trained[i]):
            return 1.0
        L = self.num_layers
        cap = L / max(1, L - num_frozen(self.current_rate(), L, self.config.rounding))
        factor = min(cap, (self._step + 1) / (int(self._train_count[i]) + 1))   # counting the step under way
        return math.sqrt(factor) if self.config.update_scale == "sqrt_share" else factor

    def _frozen_params(self) -> list[nn.Parameter]:
        return [p for p, t in zip(self.params, self._trained.tolist()) if not t]

    def _decide(self, first: bool) -> None:
        L, cfg = self.num_layers, self.config
        n_train = L - num_frozen(self.current_rate(), L, cfg.rounding)
        order = training_order(self._scores, self._seen, self._bytes, cfg.memory_aware)
        must_train: Sequence[bool] = ()
        must_freeze: Sequence[bool] = ()
        if not first:
            if cfg.min_trained_steps > 0:
                must_train = (self._trained & (self._age < cfg.min_trained_steps)).tolist()
            if cfg.min_frozen_steps > 0:
                must_freeze = (~self._trained & self._seen & (self._age < cfg.min_frozen_steps)).tolist()
            share = n_train / L if cfg.min_train_share == EVEN_SHARE else cfg.min_train_share
            if share > 0:
                order, starved = starved_first(order, self._train_count, self._step, share)
                if starved:
                    must_train = [a or b for a, b in zip(must_train or [False] * L, starved)]
        room = None if cfg.budget_bytes is None else cfg.budget_bytes - self.base_bytes
        chosen = choose_trained(order, n_train, bytes_=None if self._bytes is None else self._bytes.tolist(),
                                budget=room, must_train=must_train, must_freeze=must_freeze)
        new = torch.zeros(L, dtype=torch.bool)
        new[torch.tensor(chosen, dtype=torch.long)] = True
        if first:
            self._age.zero_()
        else:
            self._age[new != self._trained] = 0
        self._trained = new

    def _apply(self) -> None:
        for p, t in zip(self.params, self._trained.tolist()):
            if p.requires_grad != t:
                p.requires_grad_(t)
            if not t and p.grad is not None:
                p.grad = None
        self._run_frozen_set_hooks()

    @property
    def snapshots_on_update(self) -> bool:
        """True when the weight snapshots are taken right before the optimizer moves the weights (an
        optimizer is attached; sharded parameters under a chunked step) rather than at every ``step()``."""
        return self._guard is not None and (not self._sharded or self._chunked_step is not None)

    def _snapshot_before_update(self, params) -> None:
        """The guard's hook: the optimizer is about to move `params` (None: every parameter it holds). With
        a chunked step the trained layers are scored inside it, which names what it leaves to the optimizer
        (InStepScores.left_to_optimizer). Sharded layers without one keep their snapshots between steps."""
        if self._chunked_step is None and not self._sharded:
            self._take_snapshots(params)

    @torch.no_grad()
    def _take_snapshots(self, params) -> None:
        """Snapshot the trained layers among `params` (None: all) that have none yet this step."""
        if params is None:
            idx = self._trained.nonzero().flatten().tolist()
        else:
            idx = [i for i in (self._index.get(id(p)) for p in params) if i is not None and bool(self._trained[i])]
        for i in idx:
            if i not in self._snap:
                self._snap[i] = local_tensor(self.params[i]).clone()

    @torch.no_grad()
    def _snapshot(self, refresh: bool = True) -> None:
        """Snapshots of the layers that train next; ``refresh=False`` keeps existing ones."""
        idx = self._trained.nonzero().flatten().tolist()
        keep = set(idx)
        for i in [i for i in self._snap if i not in keep]:
            del self._snap[i]                                # frozen layers need no snapshot
        reuse = [i for i in idx if i in self._snap]
        if reuse and refresh:
            torch._foreach_copy_([self._snap[i] for i in reuse], [local_tensor(self.params[i]) for i in reuse])
        for i in idx:
            if i not in self._snap:
                self._snap[i] = local_tensor(self.params[i]).clone()   # a sharded layer: this rank's shard
