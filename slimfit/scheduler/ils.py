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
 1. scores the layers trained in the step that just ended against their snapshot taken at
    the previous ``step()`` (one batched reduction, one host transfer; see ``scores.py``);
    frozen layers keep their stale scores;
 2. under torch.distributed, rank 0's scores are broadcast (one collective; ``ddp.py``);
 3. chooses the next trained set (``selection.py``): never-trained layers first (round
    robin from seeded random initial scores), then the highest scores; ``round(rate * L)``
    layers are frozen, or more if a memory budget needs it (``budget.py``);
 4. flips ``requires_grad`` (and drops ``.grad`` of newly frozen layers);
 5. snapshots the weights of the layers that will train (frozen layers do not move, so
    only trained layers need a snapshot: (1 - rate) of the weights, not a full copy).

The only contract with the rest of slimfit is ``param.requires_grad``.
"""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from . import budget as _budget
from .candidates import (
    KINDS,
    TASK_HEAD,
    candidate_kinds,
    default_task_head,
    drop_always_trained,
    find_candidates,
    keep_kinds,
    resolve_layers,
    task_head_names,
    unwrap_model,
)
from .ddp import DistSync, check_parallel_wrappers, names_digest, resolve_group
from .optim import FROZEN_UPDATES, FrozenGradGuard, check_optimizer_coverage
from .scores import DEFAULT_CHUNK_NUMEL, SCORES, compute_scores
from .selection import ROUNDINGS, choose_trained, num_frozen, starved_first, training_order
from .sharded import is_sharded, local_tensor, sharded_scores

__all__ = ["ILSScheduler"]

_STATE_VERSION = 1
# Initial scores: seeded uniform in [INIT_LO, 2 * INIT_LO), far above any real score. The
# explicit "never trained" flag already puts those layers first; the size mirrors SlimFit.
INIT_LO = 1e6
# scheduled_kinds: which kinds of candidate the scheduler freezes and unfreezes; the others
# train every step. "all" is SlimFit's rule (every candidate).
ALL_KINDS = "all"
DEFAULT_SCHEDULED_KINDS = ("matmul",)
# min_train_share="even": every layer trains in the share of layers that train each step.
EVEN_SHARE = "even"
# update_scale: "none" leaves the optimizer's updates as they are; "share" scales each update of a
# scheduled layer by the inverse of its share of the steps so far (see the class docstring).
UPDATE_SCALES = ("none", "share")
# step() calls in a row without an optimizer step before the scheduler warns that it is stuck.
IDLE_WARNING_CALLS = 10


def _resolve_kinds(kinds, explicit_layers: bool) -> tuple[str, ...]:
    """scheduled_kinds as a tuple in KINDS order. None: the default, except that an explicit
    ``layers`` list is scheduled whole."""
    if kinds is None:
        kinds = ALL_KINDS if explicit_layers else DEFAULT_SCHEDULED_KINDS
    if kinds == ALL_KINDS:
        return KINDS
    names = [kinds] if isinstance(kinds, str) else list(kinds)
    bad = [k for k in names if k not in KINDS]
    if bad or not names:
        raise ValueError(f"scheduled_kinds must be {ALL_KINDS!r} or a non-empty selection of {KINDS}, got {kinds!r}")
    return tuple(k for k in KINDS if k in names)


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
    weights moved least.

    Args:
        model_or_named_params: an ``nn.Module`` (a DDP wrapper is fine and checked), or
            ``(name, parameter)`` pairs such as ``model.named_parameters()``.
        freeze_rate: fraction of the scheduled layers frozen each step, in [0, 1). At least
            one layer always trains. In budget mode, the minimum fraction frozen. Default 0.7:
            SlimFit's 0.9 lost 4.4-6.5 points on a 16-class task where 0.7 kept full fine-tuning's
            accuracy (docs/fidelity.md).
        score: ``"relative"`` (SlimFit: mean |ΔW / W_old| over entries with W_old != 0),
            ``"robust"`` (||ΔW|| / ||W_old||) or ``"absolute"`` (mean |ΔW|: under Adam the
            two relative scores rank layers by weight size and keep LayerNorm weights and
            embeddings frozen; see ``scores.py``).
        memory_aware: rank layers by score per activation byte instead of by score, so
            freezing prefers the layers that save the most memory (needs activation_bytes).
        activation_bytes: per-layer activation bytes that training the layer costs: a dict
            ``{name: bytes}`` (missing names cost 0) or a callable ``(name, param) -> bytes``.
            See ``slimfit.scheduler.estimate_activation_bytes``.
        budget_bytes: budget mode: keep ``base_bytes + sum(bytes of trained layers)`` at or
            under this; ValueError at construction when not even one layer fits.
        min_trained_steps / min_frozen_steps: a layer, once unfrozen/frozen, stays so for at
            least that many steps (soft: the frozen count and the budget win). Layers never
            trained are exempt from min_frozen_steps.
        seed: seeds the initial random scores (the round-robin order).

    Keyword-only:
        base_bytes: activation bytes no freezing can remove (budget mode). The bytes that
            ``activation_bytes`` gives the candidates left out of scheduling (``scheduled_kinds``,
            ``always_train``: they train every step) are added to it.
        rounding: ``"round"`` (default, round-half-up) or ``"floor"`` (int(), the paper's code).
        optimizer: attach now (see ``attach_optimizer``).
        layers: with a module: an explicit list of parameter names or (name, param) pairs to
            schedule instead of the default candidates; checked against the model.
        always_train: module (or parameter) names whose candidate parameters are not
            scheduled and train every step, e.g. ``["classifier"]``. ValueError when a name
            matches no candidate. ``"task_head"`` names the fresh head of a Hugging Face task
            model (``classifier`` / ``score`` / ``qa_outputs``; see ``candidates.task_head_names``)
            and raises when there is none. None (default): that head when the model has one and
            ``layers`` is not given, else nothing; ``()`` schedules the head like any layer
            (SlimFit's rule). The head trains every step by default because, scheduled, a fresh
            head trained in about a third of the steps and cost 0.8 points on Rotten Tomatoes
            (500 steps, 3 seeds: -0.85 against -0.08 with the head every step; docs/fidelity.md),
            while its activations (the pooled features) are a few KiB.
        frozen_update: ``"none"`` (default): a frozen layer does not move at all. ``"momentum"``:
            a frozen layer that has optimizer state keeps taking the optimizer's step from its
            existing moments (a zero gradient is handed to the optimizer for it), as SlimFit's
            published code effectively did on the PyTorch of its time. No activation cost; the
            zero gradients are transient (shared per shape for Adam/AdamW).
        warmup_steps: the freeze rate ramps linearly from 0 to ``freeze_rate`` over this many
            steps (0: the target rate from the start). During the ramp more layers train, so
            activation memory is higher.
        min_train_share: every layer trains in at least this share of the steps so far
            (layers below it take training slots first, the most starved first); in [0, 1 - rate],
            or ``"even"``: the share of layers that train each step (about 1 - rate), so every layer
            trains equally often (round robin) and the scores only choose among equally trained
            layers. 0 (default) is SlimFit's own schedule, the scores alone (under Adam/AdamW its
            relative score ranks layers by the size of their weights). With every kind scheduled,
            "even" did better on Rotten Tomatoes at 500 steps (6 seeds) and worse on a 16-class task
            and Fashion-MNIST (seed 0), so it is not the default (docs/fidelity.md).
        update_scale: ``"none"`` (default): the optimizer's update is left as it is. ``"share"``:
            right after the optimizer's step, each trained layer's update (its weights minus the
            snapshot) is multiplied by steps so far / steps that layer trained, capped at
            layers / trained layers, so a layer that trains one step in three moves about as far
            as under full fine-tuning (Adam's step size does not grow with the gradient, so fewer
            updates otherwise mean a shorter path). One in-place lerp per trained layer; the
            scores are taken from the unscaled update.
        scheduled_kinds: which kinds of candidate are scheduled (``candidates.candidate_kinds``):
            ``"all"`` (SlimFit's rule) or a selection of ``"matmul"`` (Linear / Conv weights, an
            embedding table tied to an LM head), ``"norm"`` (norm weights) and ``"embedding"``
            (embedding tables, position embeddings, class tokens). Candidates of the other kinds
            train every step and do not count in the rate. None: ``("matmul",)``, the default
            (freezing an embedding or a norm weight saves no activation memory, and SlimFit's score
            starved them: docs/fidelity.md), or every kind when ``layers`` lists the layers.
        release_state_after: with an attached optimizer, drop the optimizer state (e.g. AdamW's
            moments) of a layer once it has been frozen this many consecutive steps; it restarts
            from fresh state when it trains again. None (default) keeps all state.
        distributed: None = auto (torch.distributed initialised, world size > 1).
        process_group: the group to agree within (default: the world).
        chunk_numel: elements per batched score reduction (bounds temporary memory).
    """

    def __init__(self, model_or_named_params: Union[nn.Module, Iterable], freeze_rate: float = 0.7,
                 score: str = "relative", memory_aware: bool = False,
                 activation_bytes: Optional[_budget.ActivationBytes] = None,
                 budget_bytes: Optional[float] = None, min_trained_steps: int = 0,
                 min_frozen_steps: int = 0, seed: int = 0, *, base_bytes: float = 0.0,
                 rounding: str = "round", optimizer=None, layers: Optional[Iterable] = None,
                 always_train: Union[str, Iterable[str], None] = None, frozen_update: str = "none",
                 warmup_steps: int = 0, min_train_share: Union[float, str] = 0.0,
                 release_state_after: Optional[int] = None, update_scale: str = "none",
                 scheduled_kinds: Union[str, Iterable[str], None] = None,
                 distributed: Optional[bool] = None, process_group=None,
                 chunk_numel: int = DEFAULT_CHUNK_NUMEL):
        # ---- what to schedule
        if isinstance(model_or_named_params, nn.Module):
            model = model_or_named_params
            base = unwrap_model(model)
            named = resolve_layers(base, layers) if layers is not None else find_candidates(base)
            check_parallel_wrappers(model, [p for _, p in base.named_parameters()])
        else:
            if layers is not None:
                raise TypeError("layers= is only accepted together with a model")
            if isinstance(model_or_named_params, (torch.Tensor, str)):
                raise TypeError("expected a module or (name, parameter) pairs, e.g. model.named_parameters()")
            named = find_candidates(model_or_named_params)
            check_parallel_wrappers(None, [p for _, p in named])
        candidates = list(named)
        self.scheduled_kinds = _resolve_kinds(scheduled_kinds, explicit_layers=layers is not None)
        if self.scheduled_kinds != KINDS:
            module = model_or_named_params if isinstance(model_or_named_params, nn.Module) else None
            named = keep_kinds(named, candidate_kinds(module, named), self.scheduled_kinds)
        if always_train is None:  # default: a Hugging Face task model's fresh head trains every step
            always_train = (default_task_head(model_or_named_params, named)
                            if isinstance(model_or_named_params, nn.Module) and layers is None else ())
        elif always_train == TASK_HEAD:
            if not isinstance(model_or_named_params, nn.Module):
                raise TypeError('always_train="task_head" needs the model, not a parameter list')
            always_train = task_head_names(unwrap_model(model_or_named_params))
        named = drop_always_trained(named, always_train)
        self.always_train = tuple([always_train] if isinstance(always_train, str) else always_train)
        self.names: list[str] = [n for n, _ in named]
        self.params: list[nn.Parameter] = [p for _, p in named]
        L = len(self.params)

        # ---- options (validated)
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        num_frozen(freeze_rate, L, rounding)  # raises for a rate outside [0, 1)
        for nm, v in (("min_trained_steps", min_trained_steps), ("min_frozen_steps", min_frozen_steps)):
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{nm} must be an int >= 0, got {v!r}")
        if chunk_numel < 1:
            raise ValueError("chunk_numel must be >= 1")
        if frozen_update not in FROZEN_UPDATES:
            raise ValueError(f"frozen_update must be one of {FROZEN_UPDATES}, got {frozen_update!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if min_train_share != EVEN_SHARE and (
                isinstance(min_train_share, (bool, str))
                or not (0.0 <= float(min_train_share) <= 1.0 - float(freeze_rate) + 1e-12)):
            raise ValueError(f"min_train_share must be in [0, 1 - freeze_rate] = [0, {1 - freeze_rate:g}] "
                             f"(no more than the share of layers that train each step) or {EVEN_SHARE!r}, "
                             f"got {min_train_share!r}")
        if update_scale not in UPDATE_SCALES:
            raise ValueError(f"update_scale must be one of {UPDATE_SCALES}, got {update_scale!r}")
        if release_state_after is not None and (isinstance(release_state_after, bool)
                                                or not isinstance(release_state_after, int)
                                                or release_state_after < 1):
            raise ValueError(f"release_state_after must be None or an int >= 1, got {release_state_after!r}")
        self.frozen_update = frozen_update
        self.warmup_steps = warmup_steps
        self.min_train_share = min_train_share if min_train_share == EVEN_SHARE else float(min_train_share)
        self.release_state_after = release_state_after
        self.update_scale = update_scale
        self.freeze_rate = float(freeze_rate)
        self.score = score
        self.rounding = rounding
        self.memory_aware = bool(memory_aware)
        self.min_trained_steps = min_trained_steps
        self.min_frozen_steps = min_frozen_steps
        self.seed = int(seed)
        self.chunk_numel = int(chunk_numel)
        self.budget_bytes = None if budget_bytes is None else float(budget_bytes)
        self.base_bytes = float(base_bytes)
        self._bytes: Optional[torch.Tensor] = None
        if activation_bytes is not None:
            scheduled = {id(p) for _, p in named}
            self._bytes, always_bytes = _budget.resolve_activation_bytes(
                activation_bytes, named, [(n, p) for n, p in candidates if id(p) not in scheduled])
            self.base_bytes += always_bytes   # candidates that train every step cost their bytes every step
        if (self.memory_aware or self.budget_bytes is not None) and self._bytes is None:
            raise ValueError("memory_aware=True and budget_bytes need activation_bytes (a dict name -> bytes or "
                             "a callable); slimfit.scheduler.estimate_activation_bytes(model, batch) measures them")
        if self.budget_bytes is not None:
            _budget.check_budget(self._bytes, self.budget_bytes, self.base_bytes, self.names)

        # ---- state
        gen = torch.Generator().manual_seed(self.seed)
        init = INIT_LO * (1.0 + torch.rand(L, generator=gen, dtype=torch.float64))
        self._dist: Optional[DistSync] = None
        active, group = resolve_group(distributed, process_group)
        if active:
            self._dist = DistSync(group)
            init = self._dist.init_check(names_digest(self.names, [tuple(p.shape) for p in self.params]), init)
        self._scores = init
        # FSDP2 (fully_shard): parameters are DTensors; scores come from per-shard sums (sharded.py).
        self._sharded = any(is_sharded(p) for p in self.params)
        self._group = group
        if self._sharded and self._dist is None:
            raise RuntimeError("sharded (DTensor) parameters need an initialised torch.distributed process group")
        self._seen = torch.zeros(L, dtype=torch.bool)      # has a real score
        self._trained = torch.zeros(L, dtype=torch.bool)   # current decision: trains this step
        self._age = torch.zeros(L, dtype=torch.long)       # steps spent in the current state
        self._train_count = torch.zeros(L, dtype=torch.long)  # steps each layer trained so far
        self._zero_flags = [False] * L                    # W_old had zeros: zero-aware relative score
        self._step = 0
        self.skipped_steps = 0
        self._snap: dict[int, torch.Tensor] = {}
        self._guard: Optional[FrozenGradGuard] = None
        self._opt_steps_seen = 0
        self._closed = False
        self._idle_calls = 0  # step() calls in a row that followed no optimizer step
        self._warned_idle = False

        self._decide(first=True)
        self._snapshot()
        # The first frozen set is applied when training starts (the model's first forward,
        # attach_optimizer or step()), not now: an optimizer or DDP wrapper built after the
        # scheduler from `p.requires_grad` must still see every scheduled parameter, or the
        # layers frozen now would never train (Trainer builds its optimizer that way).
        self._pending = True
        self._forward_hook = None
        if isinstance(model_or_named_params, nn.Module):
            self._forward_hook = unwrap_model(model_or_named_params).register_forward_pre_hook(
                _ApplyOnFirstForward(self))
        else:
            self.apply()  # no model to watch: a parameter list is frozen at once
        if optimizer is not None:
            self.attach_optimizer(optimizer)

    # ------------------------------------------------------------------ public API
    @property
    def num_layers(self) -> int:
        return len(self.params)

    @property
    def num_frozen(self) -> int:
        return int((~self._trained).sum())

    @property
    def effective_rate(self) -> float:
        """Fraction of candidate layers frozen right now (budget mode may exceed freeze_rate)."""
        return self.num_frozen / self.num_layers

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
        """Change the rate; it takes effect at the next ``step()``."""
        num_frozen(rate, self.num_layers, self.rounding)
        self.freeze_rate = float(rate)

    def apply(self) -> None:
        """Apply the current frozen set to ``requires_grad`` now. Done by itself at the model's
        first forward, at ``attach_optimizer`` and at ``step()``; call it to freeze earlier."""
        self._pending = False
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        self._apply()

    def attach_optimizer(self, optimizer) -> FrozenGradGuard:
        """Hook ``optimizer`` so frozen parameters have ``grad is None`` at every update (or,
        with ``frozen_update="momentum"``, a zero gradient when they have optimizer state), and
        so ``step()`` can skip iterations where the optimizer did not step.

        Raises ValueError when the optimizer holds none of the scheduled parameters, and warns
        when it misses some: those layers could never train."""
        check_optimizer_coverage(optimizer, self.names, self.params)
        if self._guard is not None:
            self._guard.remove()
        self._guard = FrozenGradGuard(optimizer, self._frozen_params, frozen_update=self.frozen_update)
        self._opt_steps_seen = self._guard.steps
        self._idle_calls = 0
        if self._pending:
            self.apply()
        return self._guard

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
        if self._guard is not None:
            if self._guard.steps == self._opt_steps_seen:
                self.skipped_steps += 1
                self._idle_calls += 1
                # Gradients accumulating between calls mean micro-batches (fine); cleared
                # gradients with no step of the attached optimizer mean another optimizer steps.
                cleared = all(p.grad is None for p, t in zip(self.params, self._trained.tolist()) if t)
                if self._idle_calls >= IDLE_WARNING_CALLS and self._guard.steps == 0 and cleared \
                        and not self._warned_idle:
                    self._warned_idle = True
                    warnings.warn(
                        f"ILSScheduler.step() was called {IDLE_WARNING_CALLS} times and the attached optimizer has "
                        "never stepped, so the frozen set has not changed: attach the optimizer that updates "
                        "this model (attach_optimizer), and call step() once per optimizer step", stacklevel=2)
                return
            self._opt_steps_seen = self._guard.steps
            self._idle_calls = 0
        idx = self._trained.nonzero().flatten().tolist()
        factors = self._update_factors(idx)
        if idx:
            flags = [self._zero_flags[i] for i in idx]
            # CPU: the scoring pass refreshes the snapshots while the blocks are in cache.
            # Accelerators: refresh after the decision, only for layers that stay trained.
            in_pass = self._sharded or all(self.params[i].device.type == "cpu" for i in idx)
            if self._sharded:
                vals = sharded_scores(self.score, [self._snap[i] for i in idx], [self.params[i] for i in idx],
                                      group=self._group, refresh=True)
            else:
                vals = self._local_scores(idx, flags, in_pass)
            for i, f in zip(idx, flags):
                self._zero_flags[i] = f
            it = torch.tensor(idx, dtype=torch.long)
            if factors is not None:   # every score is linear in the update: score the unscaled one
                vals = vals.to(torch.float64) / torch.tensor(factors, dtype=torch.float64)
            self._scores[it] = vals
            self._seen[it] = True
        else:
            in_pass = False
        self._train_count += self._trained.long()
        self._age += 1
        self._step += 1
        self._decide(first=False)
        self._apply()
        self._snapshot(refresh=not in_pass)
        if self.release_state_after is not None and self._guard is not None:
            long_frozen = (~self._trained) & (self._age >= self.release_state_after)
            self._guard.release_state([self.params[i] for i in long_frozen.nonzero().flatten().tolist()])

    def state_dict(self, include_snapshots: bool = False) -> dict[str, Any]:
        """Everything the decisions depend on. Snapshots (weights at the last ``step()``) are
        left out by default: ``load_state_dict`` retakes them from the model, which is exact
        when the checkpoint was written after ``step()`` and the model weights are loaded first."""
        sd = {
            "version": _STATE_VERSION,
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
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; load the model weights first. Applies the restored
        frozen set at once."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported ILSScheduler state version {state.get('version')!r}")
        names = list(state["names"])
        if names != self.names:
            mine, theirs = set(self.names), set(names)
            missing, extra = sorted(mine - theirs), sorted(theirs - mine)
            detail = (f"missing from the state: {missing[:3]}; not in this model: {extra[:3]}"
                      if (missing or extra) else "same names in another order")
            hint = ""
            if extra and all(any(n == h or n.startswith(h + ".") for h in self.always_train) for n in extra):
                hint = (f"; the state schedules {list(self.always_train)}, which this scheduler trains every step "
                        f"(always_train; by default a task model's fresh head): build it with always_train=() "
                        f"to resume this state")
            raise ValueError(f"ILSScheduler state does not match this model's candidate layers "
                             f"({len(names)} in the state, {len(self.names)} here; {detail}){hint}")
        shapes = [tuple(s) for s in state.get("shapes", [])]
        if shapes and shapes != [tuple(p.shape) for p in self.params]:
            raise ValueError("ILSScheduler state: same layer names but different shapes")
        cfg = state.get("config", {})
        diff = {k: (v, self._config().get(k)) for k, v in cfg.items() if self._config().get(k) != v}
        if diff:
            warnings.warn(f"ILSScheduler.load_state_dict: options differ from the saved run {diff}; "
                          "decisions will follow this scheduler's options", stacklevel=2)
        L = self.num_layers
        self._scores = torch.as_tensor(state["scores"], dtype=torch.float64).clone().reshape(L)
        self._seen = torch.as_tensor(state["seen"], dtype=torch.bool).clone().reshape(L)
        self._trained = torch.as_tensor(state["trained"], dtype=torch.bool).clone().reshape(L)
        self._age = torch.as_tensor(state["age"], dtype=torch.long).clone().reshape(L)
        counts = state.get("train_count", torch.zeros(L))
        self._train_count = torch.as_tensor(counts, dtype=torch.long).clone().reshape(L)
        self._zero_flags = [bool(f) for f in state.get("zero_flags", [False] * L)]
        self._step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.apply()
        self._snap = {}
        snaps = state.get("snapshots")
        if snaps:
            for i in self._trained.nonzero().flatten().tolist():
                p = self.params[i]
                self._snap[i] = snaps[self.names[i]].to(device=p.device, dtype=p.dtype).clone()
        self._snapshot(refresh=not snaps)
        if self._guard is not None:
            self._opt_steps_seen = self._guard.steps

    def summary(self, top: int = 5) -> str:
        L = self.num_layers
        lines = [
            f"ILSScheduler: step {self._step}, {self.num_frozen}/{L} layers frozen "
            f"(rate {self.effective_rate:.3f}, target {self.freeze_rate}), score={self.score}"
            + (", memory-aware" if self.memory_aware else "")
            + (f", budget {self.budget_bytes / 2**20:.1f} MiB" if self.budget_bytes is not None else ""),
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
        return "\n".join(lines)

    def close(self) -> None:
        """Unfreeze every layer, remove optimizer hooks, free the snapshots."""
        for p in self.params:
            p.requires_grad_(True)
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        self._pending = False
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        self._snap = {}
        self._trained[:] = True
        self._closed = True

    def __repr__(self) -> str:
        return (f"ILSScheduler(layers={self.num_layers}, frozen={self.num_frozen}, freeze_rate={self.freeze_rate}, "
                f"score={self.score!r}, step={self._step})")

    # ------------------------------------------------------------------ internals
    def _config(self) -> dict[str, Any]:
        return {"freeze_rate": self.freeze_rate, "score": self.score, "rounding": self.rounding,
                "memory_aware": self.memory_aware, "budget_bytes": self.budget_bytes,
                "base_bytes": self.base_bytes, "min_trained_steps": self.min_trained_steps,
                "min_frozen_steps": self.min_frozen_steps, "seed": self.seed,
                "frozen_update": self.frozen_update, "warmup_steps": self.warmup_steps,
                "min_train_share": self.min_train_share, "release_state_after": self.release_state_after,
                "update_scale": self.update_scale, "scheduled_kinds": list(self.scheduled_kinds)}

    def _local_scores(self, idx: list[int], flags: list[bool], refresh: bool) -> torch.Tensor:
        return compute_scores(
            self.score, [self._snap[i] for i in idx], [self.params[i] for i in idx],
            chunk_numel=self.chunk_numel,
            collective=self._dist.broadcast if self._dist is not None else None, zero_flags=flags,
            refresh=refresh)

    @torch.no_grad()
    def _update_factors(self, idx: list[int]) -> Optional[list[float]]:
        """update_scale="share": stretch the update each trained layer just took (weights minus
        snapshot) by its catch-up factor, in place; returns the factors (None: nothing scaled)."""
        if self.update_scale != "share" or not idx:
            return None
        L = self.num_layers
        cap = L / max(1, L - num_frozen(self.current_rate(), L, self.rounding))
        steps = self._step + 1                               # counting the step that just ended
        counts = (self._train_count + self._trained.long()).tolist()
        factors = [min(cap, steps / counts[i]) for i in idx]
        for i, f in zip(idx, factors):
            if f != 1.0:
                # p + (f - 1) (p - snap) == lerp(p, snap, 1 - f)
                local_tensor(self.params[i]).lerp_(self._snap[i], 1.0 - f)
        return factors

    def _frozen_params(self) -> list[nn.Parameter]:
        return [p for p, t in zip(self.params, self._trained.tolist()) if not t]

    def current_rate(self) -> float:
        """The freeze rate in force for the next step (below freeze_rate during warm-up)."""
        if self.warmup_steps and self._step < self.warmup_steps:
            return self.freeze_rate * self._step / self.warmup_steps
        return self.freeze_rate

    def _decide(self, first: bool) -> None:
        L = self.num_layers
        n_train = L - num_frozen(self.current_rate(), L, self.rounding)
        order = training_order(self._scores, self._seen, self._bytes, self.memory_aware)
        must_train: Sequence[bool] = ()
        must_freeze: Sequence[bool] = ()
        if not first:
            if self.min_trained_steps > 0:
                must_train = (self._trained & (self._age < self.min_trained_steps)).tolist()
            if self.min_frozen_steps > 0:
                must_freeze = (~self._trained & self._seen & (self._age < self.min_frozen_steps)).tolist()
            share = n_train / L if self.min_train_share == EVEN_SHARE else self.min_train_share
            if share > 0:
                order, starved = starved_first(order, self._train_count, self._step, share)
                if starved:
                    must_train = [a or b for a, b in zip(must_train or [False] * L, starved)]
        room = None
        if self.budget_bytes is not None:
            room = self.budget_bytes - self.base_bytes
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
