"""Held optimizer state through ``optimizer.state_dict()`` and ``optimizer.load_state_dict()``.

Two formats (``set_checkpoint_format``; docs/optim.md, "Checkpoints"):

  "portable" (the default): any torch Adam/AdamW (or the optimizer the state came from) loads and steps it.
      Every held moment is written under its own key (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) as a
      plain tensor in host memory (an FSDP2 shard's as a DTensor placed as its parameter, the piece on the
      parameter's device, as torch and torch.distributed.checkpoint keep it): an 8-bit entry decoded a piece at
      a time (codec.decode_range; what a step from the entry would read, bit for bit), a host copy as it is.
      Beside ``state`` and ``param_groups`` the top-level key ``slimfit_held`` carries the held entries
      themselves ({index: {held key: entry}}, the same objects as in ``optimizer.state``, no copy), which
      torch's load ignores and slimfit's load uses instead of the decoded moments: the resumed run is the
      uninterrupted one bit for bit (decoding and encoding again would round differently). Bytes: torch's own
      checkpoint + the entries (AdamW fp32: 8 + 2.125 bytes a parameter; a host copy shares its storage with
      the plain key: saved once).
  "held": the state as it is held (``exp_avg@slimfit_q8``: codes, scales and offsets; ``exp_avg@slimfit_host``),
      2.125 bytes a parameter for AdamW, nothing decoded; slimfit-only, and says so under the top-level key
      ``slimfit_only``. A plain torch optimizer fails at its first step on it (KeyError 'exp_avg') unless
      ``restore_state`` decodes it after the load.

Loading (any format, and torch's own) into an optimizer with a FrozenState:
  * ``Optimizer.load_state_dict`` casts every floating tensor of the state to the parameter's dtype and
    device (uint8 codes to fp32, fp32 scales to bf16 for a bf16 model, host copies to the device): the load
    pre-hook takes the held entries (the sidecar's, and held keys inside ``state``) out of the incoming
    state before that, drops the decoded moments they stand for, and the post-hook puts them back as they
    were (8-bit entries on the parameter's device, host copies on the host, pinned for a CUDA parameter).
  * Nothing is held or restored at load: the scheduler's next frozen set (its load_state_dict or step)
    holds and restores what changed, and a held layer that steps before that is restored right before its
    step. Holding by the frozen set in force at load time would be a lossy round trip for every layer a
    scheduler state loaded next trains (a resumed run would round otherwise than the uninterrupted one).
Host copies made on a side stream are complete only when that stream gets there: the state_dict pre-hook
synchronizes it before anyone reads them.
"""
from __future__ import annotations

import weakref

import torch

from slimfit.scheduler.optim import unwrap_optimizer

from .codec import decode, decode_range
from .keys import Q8, base_key, held_key
from .sharded_params import is_dtensor, like_param

__all__ = ["install", "restore_state", "set_checkpoint_format", "held_state_dict", "FORMATS", "SIDECAR",
           "SLIMFIT_ONLY"]

FORMATS = ("portable", "held")
SIDECAR = "slimfit_held"      # portable: {param index: {held key: entry}}, what slimfit's load resumes from
SLIMFIT_ONLY = "slimfit_only"  # held: why a plain torch optimizer cannot step from it, and the fix
_SLIMFIT_ONLY_TEXT = (
    "slimfit's held optimizer state (set_checkpoint_format(opt, 'held')): moments under '<key>@slimfit_q8' "
    "(8-bit codes) or '<key>@slimfit_host', not 'exp_avg'. Load it into an optimizer with slimfit's "
    "FrozenState (ILSScheduler(model, optimizer=opt) attaches one), or call slimfit.optim.restore_state(opt) "
    "after loading it into a plain torch optimizer; a plain optimizer alone fails at its first step "
    "(KeyError 'exp_avg'). The default format ('portable') loads anywhere.")
_PIECE = 1 << 20               # elements decoded at a time: what writing a checkpoint adds beyond its own bytes
_FORMAT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # optimizer -> format ("portable" unset)


def set_checkpoint_format(optimizer, fmt: str) -> str:
    """What ``optimizer.state_dict()`` writes from now on (module docstring): "portable" (the default: any
    torch Adam/AdamW loads and steps it; slimfit resumes it exactly) or "held" (small, slimfit-only).
    Returns the format it replaces."""
    if fmt not in FORMATS:
        raise ValueError(f"set_checkpoint_format: fmt must be one of {FORMATS} ('portable': plain moments any "
                         f"torch optimizer loads, the default; 'held': 8-bit entries, slimfit-only), got {fmt!r}")
    opt = unwrap_optimizer(optimizer)
    previous = _FORMAT.get(opt, FORMATS[0])
    _FORMAT[opt] = fmt
    return previous


def held_state_dict(optimizer) -> dict:
    """``optimizer.state_dict()`` in the "held" format, once (the small, slimfit-only checkpoint)."""
    previous = set_checkpoint_format(optimizer, "held")
    try:
        return optimizer.state_dict()
    finally:
        set_checkpoint_format(optimizer, previous)


@torch.no_grad()
def _decoded_on_host(entry: dict) -> torch.Tensor:
    """The moment of a codec entry, as ``decode`` restores it, in host memory: decoded ``_PIECE`` elements at a
    time (group-aligned pieces), so the device holds at most a piece's temporaries beyond the entry."""
    out = torch.empty(tuple(entry["shape"]), dtype=entry["dtype"], device="cpu")
    flat = out.view(-1)
    group = int(entry["group_size"])
    piece = max(group, _PIECE // group * group)
    for a in range(0, flat.numel(), piece):
        b = min(flat.numel(), a + piece)
        flat[a:b].copy_(decode_range(entry, a, b))
    return out


def _written(optimizer, state_dict):
    """State_dict post-hook: the held entries written in the optimizer's format (module docstring). torch's
    inner dicts are the live ``optimizer.state[p]``: new ones are made, those are never changed."""
    held = {}
    for index, entries in state_dict["state"].items():
        mine = {k: v for k, v in entries.items() if held_key(k)}
        if mine:
            held[index] = mine
    if not held:
        return None   # nothing held: torch's own state_dict
    if _FORMAT.get(optimizer, FORMATS[0]) == "held":
        return {**state_dict, SLIMFIT_ONLY: _SLIMFIT_ONLY_TEXT}
    state = dict(state_dict["state"])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, mine in held.items():
        plain = {k: v for k, v in state[index].items() if not held_key(k)}
        for key, value in mine.items():
            plain[base_key(key)] = _as_state(_decoded_on_host(value) if key.endswith(Q8) else value,
                                             params[int(index)])
        state[index] = plain
    return {**state_dict, "state": state, SIDECAR: held}


def _as_state(moment: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A decoded moment as torch keeps it for ``p``: an FSDP2 shard's is a DTensor placed as ``p`` (its local
    piece on ``p``'s device), so torch's optimizer and torch.distributed.checkpoint take it as their own; a
    plain parameter's stays in host memory."""
    return like_param(moment.to(p.device), p) if is_dtensor(p) else moment


def _stash(manager, optimizer, state_dict):
    """Load pre-hook: a copy of ``state_dict`` without the held entries (the sidecar's and any in ``state``)
    nor the decoded moments they stand for; the entries are kept on the manager for ``_put_back``."""
    sidecar = state_dict.get(SIDECAR) or {}
    stash, state = {}, {}
    for index, entries in state_dict["state"].items():
        held = {k: v for k, v in entries.items() if held_key(k)}
        held.update(sidecar.get(index, {}))
        covered = {base_key(k) for k in held}
        if held:
            stash[index] = held
        state[index] = {k: v for k, v in entries.items() if not held_key(k) and k not in covered}
    for index, held in sidecar.items():
        stash.setdefault(index, dict(held))
    manager._stash = stash
    return {**{k: v for k, v in state_dict.items() if k not in (SIDECAR, SLIMFIT_ONLY)}, "state": state}


def _placed(key: str, value, p: torch.Tensor):
    if key.endswith(Q8):
        return {k: (v.to(p.device) if isinstance(v, torch.Tensor) else v) for k, v in value.items()}
    host = value.to("cpu")
    return host.pin_memory() if p.device.type == "cuda" else host


def _put_back(manager, optimizer) -> None:
    """Load post-hook: the stashed entries into the loaded state, as they were (module docstring)."""
    stash, manager._stash = manager._stash, {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, held in stash.items():
        p = params[int(index)]
        state = optimizer.state[p]
        for key, value in held.items():
            state[key] = _placed(key, value, p)


def install(manager) -> list:
    """The four hooks on ``manager.optimizer``; their handles."""
    opt = manager.optimizer
    return [opt.register_state_dict_pre_hook(lambda o: manager.synchronize()),
            opt.register_state_dict_post_hook(_written),
            opt.register_load_state_dict_pre_hook(lambda o, sd: _stash(manager, o, sd)),
            opt.register_load_state_dict_post_hook(lambda o: _put_back(manager, o))]


@torch.no_grad()
def restore_state(optimizer) -> int:
    """Decode every held entry of ``optimizer.state`` in place (a "held" checkpoint loaded into an optimizer
    without a FrozenState); how many parameters had one. Host copies are copied synchronously."""
    n = 0
    for p, state in list(optimizer.state.items()):
        keys = [k for k in state if held_key(k)]
        for key in keys:
            value = state.pop(key)
            if key.endswith(Q8):
                state[base_key(key)] = like_param(decode(value, device=p.device), p)
            else:
                state[base_key(key)] = like_param(value.to(p.device, copy=True), p)
        n += bool(keys)
    return n
