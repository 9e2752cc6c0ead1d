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

Optimizer state (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``) is untouched: torch
optimizers skip a parameter with no grad and keep its state, so a layer resumes with its
moments and step count when it is unfrozen.

Wrappers such as accelerate's ``AcceleratedOptimizer`` are unwrapped (``.optimizer``) so the
hooks sit on the torch optimizer that actually updates the weights.
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["unwrap_optimizer", "FrozenGradGuard"]


def unwrap_optimizer(optimizer) -> torch.optim.Optimizer:
    opt = optimizer
    for _ in range(8):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not opt:
            opt = inner
        else:
            break
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer (or a wrapper with .optimizer), got {type(optimizer).__name__}")
    return opt


class FrozenGradGuard:
    """Hooks on one optimizer. ``frozen_params`` returns the parameters frozen right now."""

    def __init__(self, optimizer, frozen_params: Callable[[], list]):
        self.optimizer = unwrap_optimizer(optimizer)
        self._frozen_params = frozen_params
        self.steps = 0             # optimizer steps seen (post-hook)
        self.dropped = 0           # grads dropped from frozen parameters (pre-hook)
        self._pre = self.optimizer.register_step_pre_hook(self._pre_hook)
        self._post = self.optimizer.register_step_post_hook(self._post_hook)

    def _pre_hook(self, optimizer, args, kwargs):
        for p in self._frozen_params():
            if p.grad is not None:
                p.grad = None
                self.dropped += 1

    def _post_hook(self, optimizer, args, kwargs):
        self.steps += 1

    def remove(self) -> None:
        self._pre.remove()
        self._post.remove()
