"""torch's Adam/AdamW step taken a bounded number of elements at a time.

torch's AdamW makes temporaries the size of what it updates in one call: the single-tensor path (the CPU's
default) two the size of the largest parameter (``exp_avg_sq.sqrt() / bias_correction2_sqrt``: 178 MiB for
BERT-base's word embedding), the foreach path (CUDA's default) one the size of every trained parameter at
once. Those temporaries sit on top of the weights, gradients and state, at the optimizer step, which is
where the peak of a small-batch step lies (docs/optim.md). A ChunkedStep hooks the optimizer's step: before
torch's step runs, it updates every parameter that has a gradient through torch's own functional Adam
(``torch.optim.adam.adam``, with the group's hyperparameters and the optimizer's own state, created by its
own ``_init_group``) on flat views of at most ``chunk_numel`` elements (small parameters packed together),
then drops their gradients, so torch's step finds nothing left to do. Every element sees the same arithmetic
as in torch's step, so weights and state are the same bit for bit (tested; the step count moves once per
parameter).

Fused groups are taken too (the fused kernel on each piece, with a GradScaler's scale and inf flag as torch's
step passes them): it makes no large temporaries, but the pieces let the scheduler score without snapshots.
What it leaves to torch's own step: a step with a closure (the closure makes the gradients inside it),
optimizers other than torch.optim.Adam and AdamW themselves (a
subclass may change the step), capturable or differentiable groups, complex, sparse or non-contiguous
parameters and tensor subclasses other than FSDP2's DTensors, parameters
whose state is held by slimfit.optim.FrozenState (its own hook puts it back first), and a torch whose
``_init_group`` has another signature.

An ``observer`` (the scheduler's in-step scoring) sees each piece of a parameter before and after its update:
``observer.wants(p)`` says whether to keep the piece's old values (a copy of one piece at a time),
``observer.piece(p, start, old, new)`` gets them (``observer.pieces(items)``, when it has it, a call's pieces
all at once), and ``observer.left_to_optimizer(params)`` names the parameters left to torch's step, right
before it moves them (the scheduler snapshots those).

With a holder (``FrozenState(between_steps=True)``, ``SchedulerConfig(frozen_state="compress_all")``) every
parameter's moments stay 8-bit between steps and are decoded a piece at a time inside this step
(held_step.py): an 8-bit AdamW, lossy. With a host holder (``optimizer_state="host"``) every moment stays in
host memory and is copied to the device and back a piece at a time inside this step (host_step.py): lossless.

FSDP2's sharded parameters (DTensors) are stepped on their rank-local pieces (sharded_params.py): Adam is
elementwise, so that is torch's own step on them, bit for bit, with every rank holding and stepping its
own shard of the moments.

``weight_rounding="stochastic"`` (``SchedulerConfig.weight_rounding``; the scheduler's default) computes each piece's
update in fp32 and writes bf16 / fp16 weights by stochastic rounding (weight_rounding.py), so updates below
half an ulp of a weight are kept in expectation instead of lost; fp32 weights are the same either way.
"""
from __future__ import annotations

import inspect
import warnings
import weakref

import torch

from slimfit._optimizer_state import DEFAULT_STEP_CHUNK_NUMEL, unwrap_optimizer

from .held_step import copies, counts_of, is_held, report_pieces, step_held, step_numbers
from .host_step import is_host_held, step_host
from .keys import held_key
from .moments import plain_tensor
from .pieces import factor_runs
from .sharded_params import global_start, is_dtensor, local, steppable
from .torch_adam import adam_step, lr_factors, scaled_group
from .weight_rounding import ROUNDED_DTYPES, WeightRounding, adam_step_rounded, check_weight_rounding

__all__ = ["ChunkedStep", "attach_chunked_step", "for_optimizer", "run_last", "DEFAULT_STEP_CHUNK_NUMEL"]

_INIT_GROUP_ARGS = ["group", "params_with_grad", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs",
                    "state_steps"]


def _init_group_matches() -> bool:
    try:
        names = list(inspect.signature(torch.optim.Adam._init_group).parameters)[1:]
    except (AttributeError, TypeError, ValueError):
        return False
    return names == _INIT_GROUP_ARGS and issubclass(torch.optim.AdamW, torch.optim.Adam)


_SUPPORTED_TORCH = _init_group_matches()


def supports(optimizer) -> bool:
    """Whether a ChunkedStep can take over some of ``optimizer``'s step (see the module docstring)."""
    return _SUPPORTED_TORCH and type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)


def _group_ok(group) -> bool:
    return not (group.get("capturable") or group.get("differentiable"))


def _layout_ok(p) -> bool:
    """A parameter (and gradient) this step can update a flat piece at a time: a plain dense tensor, or an
    FSDP2 DTensor whose local pieces are (sharded_params.py)."""
    if is_dtensor(p):
        return steppable(p) and _plain_layout_ok(local(p), local(p.grad))
    return _plain_layout_ok(p.detach(), p.grad)


def layout_ok_without_grad(p) -> bool:
    """Whether ``p`` is a parameter this step updates a flat piece at a time once it has a gradient of its own
    layout (a plain dense contiguous real tensor, or an FSDP2 DTensor whose local piece is one)."""
    if is_dtensor(p):
        if any(pl.is_partial() for pl in p.placements):
            return False
        p = local(p)
    return plain_tensor(p.detach()) and not p.is_sparse and not p.is_complex() and p.is_contiguous()


def _plain_layout_ok(p, g) -> bool:
    return (plain_tensor(p) and not p.is_sparse and not g.is_sparse and not p.is_complex()
            and p.is_contiguous() and g.is_contiguous() and g.dtype == p.dtype and g.shape == p.shape)


def _param_ok(p, state) -> bool:
    return _layout_ok(p) and not any(held_key(k) for k in state)


def _warn_fp16_eps(group, params) -> bool:
    """Warn (and say so) when an Adam group's eps rounds to 0 in fp16 for fp16 weights: torch's step keeps
    the moments in the weights' dtype, where eps (1e-8 by default) and a squared gradient below fp16's
    smallest normal become 0, so m / (sqrt(v) + eps) turns inf or NaN at the first step."""
    if group["eps"] >= torch.finfo(torch.float16).tiny or not any(p.dtype == torch.float16 for p in params):
        return False
    warnings.warn(f"Adam/AdamW on float16 weights with eps={group['eps']:g}: eps and small squared gradients "
                  "round to 0 in float16 moments, so the update becomes inf or NaN (torch's own step does the "
                  "same). Use eps >= 1e-4, bfloat16 weights, or fp32 weights with autocast", stacklevel=4)
    return True


def _flat(t, a, b):
    return t.view(-1)[a:b]


@torch.no_grad()
def _step_group(optimizer, group, params, chunk_numel, observer, rounding=None) -> None:
    """torch's Adam step of ``params`` (every one with a gradient), chunk by chunk, then their gradients dropped.
    ``rounding`` (a WeightRounding, or None: nearest): bf16 / fp16 weights written by stochastic rounding."""
    ps, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], [], [], []
    has_complex = optimizer._init_group({**group, "params": params}, ps, grads, exp_avgs, exp_avg_sqs, max_sqs,
                                        steps)
    if has_complex or len(ps) != len(params):   # (filtered out before; kept as a guard)
        return
    # the parameters (DTensors under FSDP2) for the observer, the seeds and the gradients; their local pieces
    # (the tensors themselves when not sharded) for the arithmetic
    owners = ps
    ps, grads, exp_avgs, exp_avg_sqs, max_sqs = ([local(t) for t in ts] for ts in (ps, grads, exp_avgs,
                                                                                     exp_avg_sqs, max_sqs))
    amsgrad = group["amsgrad"]
    watched = [observer is not None and observer.wants(p) for p in owners]
    last: list = [None] * len(ps)   # every piece of a parameter starts from its step count, moved at the end
    if rounding is not None and not any(p.dtype in ROUNDED_DTYPES for p in ps):
        rounding = None   # fp32 weights: nothing to round, and no step count to read on the host per piece
    numbers = None if rounding is None else step_numbers(steps)
    starts = None if rounding is None else [global_start(p) for p in owners]
    for factor, batch in factor_runs(ps, lr_factors(observer, owners), chunk_numel):
        views = [(_flat(ps[i], a, b), _flat(grads[i], a, b), _flat(exp_avgs[i], a, b), _flat(exp_avg_sqs[i], a, b),
                  _flat(max_sqs[i], a, b) if amsgrad else None) for i, a, b in batch]
        counts = counts_of([steps[i] for i, _, _ in batch])
        seen = [j for j, (i, _, _) in enumerate(batch) if watched[i]]
        olds = dict(zip(seen, copies([views[j][0] for j in seen]))) if seen else {}
        args = ([v[0] for v in views], [v[1] for v in views], [v[2] for v in views], [v[3] for v in views],
                [v[4] for v in views], counts)
        if rounding is None:
            adam_step(optimizer, scaled_group(group, factor), *args)
        else:
            adam_step_rounded(optimizer, scaled_group(group, factor), *args,
                              [rounding.seed(owners[i], numbers[i], a + starts[i]) for i, a, _ in batch])
        for j, (i, _, _) in enumerate(batch):
            last[i] = counts[j]
        if olds:
            report_pieces(observer, [(owners[batch[j][0]], batch[j][1], old, views[j][0])
                                     for j, old in olds.items()])
        del views, olds
    moved = [(s, c) for s, c in zip(steps, last) if c is not None]
    if moved:
        torch._foreach_copy_([s for s, _ in moved], [c for _, c in moved])
    for p in owners:
        p.grad = None


# optimizer -> (its ChunkedStep, that step's hook id). The optimizer keeps the ChunkedStep alive through its
# hook, and the ChunkedStep holds the optimizer weakly: no cycle.
_STEPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _stepped_held(state, group) -> bool:
    """Held moments this step updates a piece at a time: every moment 8-bit, or every moment on the host."""
    return is_held(state, group) or is_host_held(state, group)


def for_optimizer(optimizer) -> "ChunkedStep | None":
    """The ChunkedStep hooked on ``optimizer`` (None when there is none)."""
    entry = _STEPS.get(optimizer)
    return None if entry is None else entry[0]


def run_last(optimizer) -> None:
    """Move ``optimizer``'s ChunkedStep hook (if any) behind every step pre-hook registered so far: a hook
    added later that must see the gradients or the state first (FrozenState puts held state back and waits
    for its copies there) calls this."""
    entry = _STEPS.get(optimizer)
    hooks = getattr(optimizer, "_optimizer_step_pre_hooks", None)
    if entry is not None and hooks is not None and entry[1] in hooks:
        hooks.move_to_end(entry[1])


class ChunkedStep:
    """Takes over ``optimizer``'s step (torch.optim.Adam / AdamW) chunk by chunk: see the module docstring.
    Its step pre-hook runs after the hooks registered before it (the scheduler's guard, FrozenState) and
    after a FrozenState attached later (``run_last``). ``remove()`` takes it off. On an in-backward
    optimizer (slimfit.optim.step_in_backward) it hooks each per-parameter optimizer."""

    def __init__(self, optimizer, chunk_numel: int = DEFAULT_STEP_CHUNK_NUMEL, observer=None,
                 weight_rounding: str = "nearest", seed: int = 0):
        if isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel < 1:
            raise ValueError(f"ChunkedStep: chunk_numel must be a positive int (elements per call), got "
                             f"{chunk_numel!r}")
        self.chunk_numel = int(chunk_numel)
        self._observer = weakref.ref(observer) if observer is not None else None
        opt = unwrap_optimizer(optimizer)
        inner = getattr(opt, "optimizers", None)        # an InBackwardOptimizer: one optimizer per parameter
        targets = [t for t in (list(inner.values()) if isinstance(inner, dict) else [opt])
                   if supports(t) and any(_group_ok(g) for g in t.param_groups)]
        # The optimizers hold this object through their hooks (it lives as long as they do, kept or not);
        # it holds them weakly, so that is no reference cycle.
        self._optimizers = [weakref.ref(t) for t in targets]
        self.pieces_stepped = 0    # parameters updated chunk by chunk (counted for tests and reports)
        self._handles = [t.register_step_pre_hook(self._pre_hook) for t in targets]
        for t, h in zip(targets, self._handles):
            _STEPS[t] = (self, h.id)
        self._post_handles = [t.register_step_post_hook(self._post_hook) for t in targets]
        self._thawed: list = []   # moments put back in full for a step with a closure, held again after it
        self._holder = None   # a FrozenState(between_steps=True) holding every moment 8-bit (held_step.py)
        self._rounding = None   # a WeightRounding: bf16 / fp16 weights written by stochastic rounding
        self._warned_fp16 = False
        self.set_weight_rounding(weight_rounding, seed)

    def set_weight_rounding(self, weight_rounding: str, seed: int = 0) -> None:
        """How the bf16 / fp16 weights it updates are rounded: "nearest" (torch's step, bit for bit) or
        "stochastic" (the update computed in fp32 a piece at a time, the weight rounded stochastically from
        ``seed``, deterministic: weight_rounding.py). fp32 weights are the same either way."""
        check_weight_rounding(weight_rounding)
        self.weight_rounding = weight_rounding
        self._rounding = WeightRounding(seed) if weight_rounding == "stochastic" else None

    @property
    def optimizers(self) -> list:
        """The optimizers it hooks (torch Adam/AdamW ones; each per-parameter one of a step in backward)."""
        return [t for t in (r() for r in self._optimizers) if t is not None]

    @property
    def active(self) -> bool:
        return bool(self._handles)

    @property
    def observer(self):
        return None if self._observer is None else self._observer()

    @property
    def holder(self):
        return None if self._holder is None else self._holder()

    def set_holder(self, holder) -> None:
        """``holder`` (a FrozenState with between_steps=True, held weakly; None: none) keeps every moment
        8-bit (or on the host) between steps: the parameters it holds are stepped a piece at a time from there."""
        self._holder = None if holder is None else weakref.ref(holder)

    def takes(self, p, group, state) -> bool:
        """Whether this step updates ``p`` (of param group ``group``, with optimizer state ``state``) itself when
        it has a gradient (held state included, with a holder)."""
        if group is None or not _group_ok(group) or p.grad is None or not _layout_ok(p):
            return False
        return not any(held_key(k) for k in state) or (self.holder is not None and _stepped_held(state, group))

    def _pre_hook(self, optimizer, args, kwargs) -> None:
        observer = self.observer
        # torch hands its pre-hooks the step's arguments with the optimizer first: (self, closure)
        if (args[1] if len(args) > 1 else kwargs.get("closure")) is not None:
            self._leave_to_closure(optimizer, observer)
            return
        left = []
        rounding = self._rounding
        if rounding is not None:
            rounding.index(p for t in self.optimizers for g in t.param_groups for p in g["params"])
        for group in optimizer.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            if not with_grad:
                continue
            if not _group_ok(group):
                left += with_grad
                continue
            self._warned_fp16 = self._warned_fp16 or _warn_fp16_eps(group, with_grad)
            holder = self.holder
            held = []
            if holder is not None:   # every moment 8-bit between steps: fresh state made held, held stepped so
                for p in with_grad:
                    if not optimizer.state.get(p) and _layout_ok(p) and holder.can_hold(p):
                        optimizer.state[p] = holder.new_state(p, group)
                held = [p for p in with_grad if _layout_ok(p) and _stepped_held(optimizer.state[p], group)]
            taken = {id(p) for p in held}
            ours = [p for p in with_grad if id(p) not in taken and _param_ok(p, optimizer.state.get(p, {}))]
            taken.update(id(p) for p in ours)
            left += [p for p in with_grad if id(p) not in taken]
            if ours:
                _step_group(optimizer, group, ours, self.chunk_numel, observer, rounding)
                self.pieces_stepped += len(ours)
                if holder is not None:   # state that was in full (restored by hand, a checkpoint): held from now
                    for p in ours:
                        holder.hold(p)
            if held:
                stepper = step_held if holder.mode == "compress" else step_host
                stepper(optimizer, group, held, self.chunk_numel, observer, holder, rounding)
                self.pieces_stepped += len(held)
        if left and observer is not None:
            observer.left_to_optimizer(left)

    def _leave_to_closure(self, optimizer, observer) -> None:
        """A closure computes the gradients inside torch's step, after this hook: torch steps everything, from
        moments in full, held again right after it (_post_hook)."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if self.holder is not None:
            self._thawed = [p for p in params if p.requires_grad]
            self.holder.thaw(self._thawed)
            self.holder.wait()
        if observer is not None:
            observer.left_to_optimizer(params)

    def _post_hook(self, optimizer, args, kwargs) -> None:
        holder, thawed, self._thawed = self.holder, self._thawed, []
        if holder is not None:
            for p in thawed:
                holder.hold(p)

    def remove(self) -> None:
        for h in self._post_handles:
            h.remove()
        self._post_handles = []
        for ref, h in zip(self._optimizers, self._handles):
            h.remove()
            t = ref()
            if t is not None and _STEPS.get(t, (None,))[0] is self:
                del _STEPS[t]
        self._handles = []


def attach_chunked_step(optimizer, chunk_numel: int = DEFAULT_STEP_CHUNK_NUMEL, observer=None,
                        weight_rounding: str = "nearest", seed: int = 0) -> ChunkedStep:
    """A ChunkedStep on ``optimizer`` (see ChunkedStep; ``weight_rounding``: ChunkedStep.set_weight_rounding)."""
    return ChunkedStep(optimizer, chunk_numel, observer, weight_rounding, seed)
