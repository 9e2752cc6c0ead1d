"""Make frozen parameters truly stand still under any torch optimizer.

torch optimizers update every parameter whose ``.grad`` is not None, whatever its
``requires_grad``; a zero gradient is not "no update": AdamW still applies momentum and
weight decay (the leak in SlimFit's research code, where ``zero_grad()`` of old torch
versions left zero tensors behind). So:

* when the scheduler freezes a parameter it sets ``param.grad = None`` at once;
* a step pre-hook on the optimizer (``register_step_pre_hook``) drops the ``.grad`` of
  every parameter the scheduler has frozen right before the update. That covers callers of
  ``zero_grad(set_to_none=False)`` (zero-filled grads) and gradients that arrived by other
  routes. It is a pointer assignment per frozen parameter: no kernel, no host sync.
* a step post-hook counts optimizer steps, so the scheduler can tell a skipped step (AMP's
  GradScaler skips the update on inf/NaN) from a real one.
* ``before_update`` (the scheduler's weight snapshots) runs right before the weights move: in the
  step pre-hook, and for an optimizer that steps each parameter inside backward
  (slimfit.optim.step_in_backward) right before each parameter's own step.

Optimizer state (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``) is untouched: torch
optimizers skip a parameter with no grad and keep its state, so a layer resumes with its
moments and step count when it is unfrozen.

``frozen_update="momentum"`` is the opposite choice, on purpose: a frozen parameter that has
optimizer state is handed a zero gradient for the update, so AdamW keeps moving it by its
decaying first moment (and weight decay), as SlimFit's published code did on the PyTorch of its
time (``zero_grad()`` left zero-filled gradients). Parameters with no state yet (never trained)
still stand still. The zero gradients live only during ``optimizer.step()``; for the
non-fused Adam/AdamW, which only read gradients, one zero tensor per shape is shared.

Wrappers such as accelerate's ``AcceleratedOptimizer`` are unwrapped (``.optimizer``) so the
hooks sit on the torch optimizer that actually updates the weights.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Callable

import torch

from slimfit._optimizer_state import unwrap_optimizer

__all__ = ["unwrap_optimizer", "FrozenGradGuard", "check_optimizer_coverage", "FROZEN_UPDATES"]

FROZEN_UPDATES = ("none", "momentum")


def check_optimizer_coverage(optimizer, names: list, params: list) -> None:
    """ValueError when ``optimizer`` holds none of the scheduled ``params``; a warning naming
    the first few when it misses some (a layer the optimizer does not hold never trains)."""
    opt = unwrap_optimizer(optimizer)
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    missing = [n for n, p in zip(names, params) if id(p) not in held]
    if len(missing) == len(params):
        raise ValueError(
            f"the optimizer holds none of the {len(params)} layers the scheduler schedules: it belongs to another "
            "model, or was built from parameters that were frozen at the time; build it over model.parameters()")
    if missing:
        warnings.warn(
            f"the optimizer does not hold {len(missing)} of the {len(params)} scheduled layers (e.g. {missing[:3]}); "
            "they will never train. Build the optimizer over model.parameters() (the scheduler flips "
            "requires_grad every step, so filtering on p.requires_grad at build time drops layers)", stacklevel=3)


def _reads_grads_only(opt: torch.optim.Optimizer) -> bool:
    """Optimizers known to read .grad without writing it (safe to share one zero tensor)."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return not any(g.get("fused") or g.get("differentiable") for g in opt.param_groups)


def weak_method(method, default=None) -> Callable:
    """`method` (a bound method) called through a weak reference to its object; `default` once it is gone.
    Hooks and callbacks between the optimizer, the guard and the scheduler hold each other this way: bound
    methods would make them (and through the scheduler the model's parameters) a reference cycle, which only
    the cyclic GC frees: on a GPU the memory of weights and optimizer state stays taken after `del` until then."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        return default if bound is None else bound(*args)

    return call


class FrozenGradGuard:
    """Hooks on one optimizer. ``frozen_params`` returns the parameters frozen right now."""

    def __init__(self, optimizer, frozen_params: Callable[[], list], frozen_update: str = "none",
                 before_update: Callable | None = None):
        if not isinstance(frozen_update, str) or frozen_update not in FROZEN_UPDATES:
            raise ValueError(f"frozen_update must be one of {FROZEN_UPDATES}, got {frozen_update!r}")
        if not callable(frozen_params):
            raise TypeError(f"frozen_params must be a callable that returns the parameters frozen right now "
                            f"(e.g. lambda: frozen), got {type(frozen_params).__name__}")
        self.optimizer = unwrap_optimizer(optimizer)
        self._frozen_params = frozen_params
        self.frozen_update = frozen_update
        self.steps = 0             # optimizer steps seen (post-hook)
        self.dropped = 0           # grads dropped from frozen parameters (pre-hook)
        self.momentum_updates = 0  # frozen parameters moved by their moments (frozen_update="momentum")
        self._zero_filled: list = []
        self._shared_zeros: dict = {}
        self._pre = self.optimizer.register_step_pre_hook(weak_method(self._pre_hook))
        self._post = self.optimizer.register_step_post_hook(weak_method(self._post_hook))
        # before_update(params): params about to move (None: every parameter the step may update)
        self._before_update = before_update
        self._param_pre = None
        if before_update is not None and hasattr(self.optimizer, "register_param_step_pre_hook"):
            self._param_pre = self.optimizer.register_param_step_pre_hook(weak_method(self._param_pre_hook))

    def _zeros(self, p: torch.Tensor) -> torch.Tensor:
        if not _reads_grads_only(self.optimizer):
            return torch.zeros_like(p)
        key = (tuple(p.shape), p.dtype, p.device)
        z = self._shared_zeros.get(key)
        if z is None:
            z = self._shared_zeros[key] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return z

    def _param_pre_hook(self, p):
        self._before_update([p])

    def _pre_hook(self, optimizer, args, kwargs):
        if self._before_update is not None and self._param_pre is None:   # else: each parameter's own hook
            self._before_update(None)
        momentum = self.frozen_update == "momentum"
        state = self.optimizer.state
        for p in self._frozen_params():
            if momentum and state.get(p):
                p.grad = self._zeros(p)
                self._zero_filled.append(p)
                self.momentum_updates += 1
            elif p.grad is not None:
                p.grad = None
                self.dropped += 1

    def _post_hook(self, optimizer, args, kwargs):
        self.steps += 1
        for p in self._zero_filled:
            p.grad = None
        self._zero_filled.clear()
        self._shared_zeros.clear()

    def release_state(self, params: list) -> int:
        """Drop the optimizer state of ``params`` (they restart from fresh state when they
        train again); returns how many had state."""
        n = 0
        for p in params:
            if self.optimizer.state.pop(p, None) is not None:
                n += 1
        return n

    def remove(self) -> None:
        self._pre.remove()
        self._post.remove()
        if self._param_pre is not None:
            self._param_pre.remove()
