"""Held optimizer state through ``optimizer.state_dict()`` and ``optimizer.load_state_dict()``.

A checkpoint carries the frozen layers' state as it is held (8-bit entries or host copies): nothing is
restored for it, so saving costs no memory. Two things need care:
  * host copies made on a side stream are complete only when that stream gets there: the state_dict
    pre-hook synchronizes it before anyone reads them;
  * ``Optimizer.load_state_dict`` casts every floating tensor of the state to the parameter's dtype and
    device (uint8 codes to fp32, fp32 scales to bf16 for a bf16 model, host copies to the device): the
    load pre-hook takes the held entries out of the incoming state before that, and the post-hook puts
    them back as they were (8-bit entries on the parameter's device, host copies on the host, pinned for
    a CUDA parameter). Nothing is held or restored at load: the scheduler's next frozen set (its
    load_state_dict or step) holds and restores what changed, and a held layer that steps before that is
    restored right before its step. Holding by the frozen set in force at load time would be a lossy round
    trip for every layer a scheduler state loaded next trains (a resumed run would round otherwise than
    the uninterrupted one).
A checkpoint with held state loads into a plain optimizer too (``restore_state`` then decodes it).
"""
from __future__ import annotations

import torch

from .codec import decode
from .keys import Q8, base_key, held_key

__all__ = ["install", "restore_state"]


def _stash(manager, optimizer, state_dict):
    """Load pre-hook: a copy of ``state_dict`` without the held entries, which are kept on the manager."""
    stash, state = {}, {}
    for index, entries in state_dict["state"].items():
        held = {k: v for k, v in entries.items() if held_key(k)}
        if held:
            stash[index] = held
        state[index] = {k: v for k, v in entries.items() if not held_key(k)}
    manager._stash = stash
    return {**state_dict, "state": state}


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
    """The three hooks on ``manager.optimizer``; their handles."""
    opt = manager.optimizer
    return [opt.register_state_dict_pre_hook(lambda o: manager.synchronize()),
            opt.register_load_state_dict_pre_hook(lambda o, sd: _stash(manager, o, sd)),
            opt.register_load_state_dict_post_hook(lambda o: _put_back(manager, o))]


@torch.no_grad()
def restore_state(optimizer) -> int:
    """Decode every held entry of ``optimizer.state`` in place (a checkpoint with held state loaded into an
    optimizer without a FrozenState); how many parameters had one. Host copies are copied synchronously."""
    n = 0
    for p, state in list(optimizer.state.items()):
        keys = [k for k in state if held_key(k)]
        for key in keys:
            value = state.pop(key)
            if key.endswith(Q8):
                state[base_key(key)] = decode(value, device=p.device)
            else:
                state[base_key(key)] = value.to(p.device, copy=True)
        n += bool(keys)
    return n
