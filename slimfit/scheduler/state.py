"""Checks of a saved ILSScheduler state, before any of it is loaded.

``ILSScheduler.load_state_dict`` calls ``check_state`` first and changes nothing until it returns: a
state that does not fit the scheduler (another model, a corrupted or hand-edited file, a newer format)
raises a ValueError that names what is wrong and what to do, instead of failing halfway through the
load (``shape '[4]' is invalid for input of size 5``) with the scheduler half restored.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch

__all__ = ["STATE_VERSION", "check_state", "config_changes"]

# The format of ILSScheduler.state_dict(); load_state_dict refuses the versions it does not know.
STATE_VERSION = 1
REQUIRED = ("names", "scores", "seen", "trained", "age", "step")
# Per-layer vectors: key -> (dtype loaded as, what the saved values must be).
_VECTORS = {
    "scores": (torch.float64, "real numbers"),
    "seen": (torch.bool, "bools"),
    "trained": (torch.bool, "bools"),
    "age": (torch.long, "ints >= 0"),
    "train_count": (torch.long, "ints >= 0"),
}
_FIX = "pass the dict ILSScheduler.state_dict() returned for this model (e.g. a checkpoint's slimfit_ils.pt), unchanged"


def _error(problem: str, fix: str = _FIX) -> ValueError:
    return ValueError(f"ILSScheduler.load_state_dict: {problem}; {fix}")


def _shown(value) -> str:
    return f"{type(value).__name__} {value!r:.60}"


def check_state(state, names: list[str], shapes: list[tuple], local_shapes: list[tuple],
                always_train: Sequence[str]) -> dict[str, Any]:
    """The loaded values of ``state`` (tensors of the scheduler's dtypes, copies), after checking all of
    it against a scheduler of layers ``names`` with parameters of ``shapes`` (``local_shapes``: this
    rank's shards, what snapshots hold). Raises ValueError naming the first problem."""
    _check_envelope(state)
    _check_names(state["names"], names, always_train)
    _check_shapes(state.get("shapes"), names, shapes)
    L = len(names)
    new: dict[str, Any] = {}
    for key, (dtype, what) in _VECTORS.items():
        new[key] = _vector(state, key, L, dtype, what)
    if not bool(new["trained"].any()):
        raise _error("'trained' trains no layer, and at least one layer always trains")
    flags = state.get("zero_flags", [False] * L)
    if not isinstance(flags, (list, tuple)) or len(flags) != L or not all(isinstance(f, bool) for f in flags):
        raise _error(f"'zero_flags' must be a list of {L} bools (one per layer), got {_shown(flags)}")
    new["zero_flags"] = list(flags)
    new["step"] = _count(state, "step")
    new["skipped_steps"] = _count(state, "skipped_steps")
    new["snapshots"] = _snapshots(state.get("snapshots"), names, local_shapes, new["trained"])
    new["in_step_sums"] = _in_step_sums(state.get("in_step_sums"), names, new["trained"])
    config = state.get("config", {})
    if not isinstance(config, Mapping):
        raise _error(f"'config' must be a dict of options, got {_shown(config)}")
    return new


def _check_envelope(state) -> None:
    if not isinstance(state, Mapping):
        raise _error(f"expects the dict from ILSScheduler.state_dict(), got {_shown(state)}")
    if "version" not in state:
        raise _error(f"this dict has no 'version', so it is not an ILSScheduler state (its keys begin "
                     f"{sorted(map(str, state))[:4]}: a model's or an optimizer's state_dict?)")
    version = state["version"]
    if type(version) is not int or version != STATE_VERSION:
        raise _error(f"state version {version!r} is unknown (this slimfit reads version {STATE_VERSION}): written "
                     "by another slimfit version", "load it with the slimfit that wrote it, or start the schedule "
                     "afresh (a new ILSScheduler without load_state_dict)")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise _error(f"the state lacks {missing}")


def _check_names(saved, names: list[str], always_train: Sequence[str]) -> None:
    if not isinstance(saved, (list, tuple)) or not all(isinstance(n, str) for n in saved):
        raise _error(f"'names' must be a list of layer names, got {_shown(saved)}")
    saved = list(saved)
    if saved == names:
        return
    mine, theirs = set(names), set(saved)
    missing, extra = sorted(mine - theirs), sorted(theirs - mine)
    detail = (f"missing from the state: {missing[:3]}; not in this model: {extra[:3]}"
              if (missing or extra) else "same names in another order")
    fix = ("build the scheduler with the model and options of the saved run (the same layers scheduled), or "
           "start the schedule afresh")
    if extra and all(any(n == h or n.startswith(h + ".") for h in always_train) for n in extra):
        fix = (f"the state schedules {list(always_train)}, which this scheduler trains every step "
               f"(always_train; by default a task model's fresh head): build it with always_train=() "
               f"to resume this state")
    raise _error(f"the state does not match this model's candidate layers ({len(saved)} in the state, "
                 f"{len(names)} here; {detail})", fix)


def _check_shapes(saved, names: list[str], shapes: list[tuple]) -> None:
    if saved is None:
        return
    try:
        saved = [tuple(int(d) for d in s) for s in saved]
    except (TypeError, ValueError):
        raise _error(f"'shapes' must be a list of parameter shapes, got {_shown(saved)}") from None
    if len(saved) != len(shapes):
        raise _error(f"'shapes' has {len(saved)} entries for {len(shapes)} layers")
    for name, theirs, mine in zip(names, saved, shapes):
        if theirs != mine:
            raise _error(f"same layer names but different shapes: {name!r} is {list(theirs)} in the state and "
                         f"{list(mine)} here", "the state belongs to another model (another size); load the "
                         "state of this model's run")


def _vector(state, key: str, L: int, dtype: torch.dtype, what: str) -> torch.Tensor:
    """``state[key]`` as a 1-D tensor of ``L`` entries of ``dtype`` (a copy); train_count defaults to zeros."""
    value = state.get(key, torch.zeros(L, dtype=torch.long)) if key == "train_count" else state[key]
    if not isinstance(value, (torch.Tensor, list, tuple)):
        raise _error(f"'{key}' must be a tensor of {L} {what} (one per layer), got {_shown(value)}")
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise _error(f"'{key}' must be a tensor of {L} {what} (one per layer), got {_shown(value)}") from None
    if t.dim() != 1 or t.numel() != L:
        raise _error(f"'{key}' has shape {list(t.shape)}, not [{L}]: one entry per layer, and this scheduler has "
                     f"{L} layers")
    if dtype == torch.bool:
        ok = t.dtype == torch.bool
    elif dtype == torch.long:
        ok = not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
    else:
        ok = t.dtype != torch.bool and not t.is_complex()
    if not ok:
        raise _error(f"'{key}' must hold {what}, got a tensor of {t.dtype}")
    if dtype == torch.long and bool((t < 0).any()):
        raise _error(f"'{key}' must hold {what}, got the negative value {int(t.min())}")
    return t.to(dtype).clone()


def _count(state, key: str) -> int:
    value = state.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise _error(f"'{key}' must be an int >= 0 (a step count), got {_shown(value)}")
    return int(value)


def _snapshots(snaps, names: list[str], shapes: list[tuple], trained: torch.Tensor) -> Optional[dict]:
    """Saved snapshots (``state_dict(include_snapshots=True)``): one tensor per trained layer, of the
    layer's (local) shape."""
    if not snaps:
        return None
    if not isinstance(snaps, Mapping):
        raise _error(f"'snapshots' must be a dict {{layer name: tensor}}, got {_shown(snaps)}")
    for i in trained.nonzero().flatten().tolist():
        t = snaps.get(names[i])
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shapes[i]):
            got = f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else _shown(t)
            raise _error(f"'snapshots' must hold a tensor of shape {list(shapes[i])} for the trained layer "
                         f"{names[i]!r}, got {got}")
    return dict(snaps)


def _in_step_sums(sums, names: list[str], trained: torch.Tensor) -> dict:
    """Score sums of layers scored inside the optimizer step (saved mid-step): {trained layer name: [total,
    count, moved]}, three numbers each."""
    if not sums:
        return {}
    if not isinstance(sums, Mapping):
        raise _error(f"'in_step_sums' must be a dict {{layer name: [total, count, moved]}}, got {_shown(sums)}")
    allowed = {names[i] for i in trained.nonzero().flatten().tolist()}
    for name, v in sums.items():
        if name not in allowed:
            raise _error(f"'in_step_sums' names {name!r}, which is not a layer this state trains")
        if (not isinstance(v, (list, tuple)) or len(v) != 3
                or not all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in v)):
            raise _error(f"'in_step_sums' must hold three numbers [total, count, moved] for {name!r}, "
                         f"got {_shown(v)}")
    return {k: [float(x) for x in v] for k, v in sums.items()}


def config_changes(saved: Optional[Mapping], mine: Mapping) -> dict:
    """{option: (saved value, value here)} for the options a state was saved with that differ here
    (options the state does not hold, or this scheduler does not know, are not compared)."""
    if not saved:
        return {}
    return {k: (v, mine[k]) for k, v in saved.items() if k in mine and _differs(mine[k], v)}


def _differs(a, b) -> bool:
    try:
        return bool(a != b)
    except (RuntimeError, TypeError, ValueError):   # values that do not compare to a bool (tensors)
        return True
