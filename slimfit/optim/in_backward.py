"""The optimizer step inside backward: each parameter is updated as soon as its gradient is ready.

PyTorch's ``register_post_accumulate_grad_hook`` pattern: one optimizer per parameter; when a parameter's
gradient has been accumulated, its optimizer steps and the gradient is freed. So at most a few layers'
gradients are alive at once (not the whole model's), and a multi-tensor (foreach) optimizer makes its
temporaries over one parameter at a time, not over every trained parameter at once. The hook runs after
every backward node that uses the parameter (its gradient is complete), so the update never changes a
value backward still needs, and the weights are those of a plain loop with the same optimizer (tested).

    opt = step_in_backward(model, torch.optim.AdamW, lr=1e-4, weight_decay=0.01)
    sched = ILSScheduler(model, freeze_rate=0.7, optimizer=opt)   # optional
    for batch in loader:
        model(**batch).loss.backward()   # every parameter with a gradient steps here
        opt.step()                       # ends the step: step hooks run (the scheduler counts it); it also
                                         # steps any parameter still holding a gradient set by other means
        sched.step()

Frozen parameters (``requires_grad=False``) get no gradient, so their hook never fires: they are skipped.
The returned object is a ``torch.optim.Optimizer``: its ``param_groups`` are the per-parameter optimizers'
own groups (an LR scheduler changes them), its ``state`` maps each parameter to its optimizer's state, and
``state_dict`` / ``load_state_dict`` work as for one optimizer with one group per parameter.

What cannot work in this mode: gradient clipping by the total norm (the norm needs every gradient before
any update; ``clip_grad_norm`` and friends are refused with the reason; ``torch.nn.utils.clip_grad_norm_``
called after backward finds no gradient and returns 0), gradient accumulation over micro-batches (every
backward steps), AMP's GradScaler (it unscales and checks for inf after backward, too late), closures, and
DistributedDataParallel (its gradient all-reduce happens after the hook).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .per_param_state import PerParamState

__all__ = ["InBackwardOptimizer", "step_in_backward", "CLIPPING_OPTIONS"]

CLIPPING_OPTIONS = ("clip_grad_norm", "max_grad_norm", "max_norm", "grad_clip", "clip_grad_value")
_CLIPPING = ("gradient clipping cannot work with the optimizer step in backward: each parameter is updated as "
             "soon as its own gradient is ready, before the other gradients exist, so there is no total norm to "
             "clip by. Train without clipping, or use a plain optimizer loop (clip_grad_norm_ then step())")


def _parameters(model_or_params) -> list[nn.Parameter]:
    if isinstance(model_or_params, nn.parallel.DistributedDataParallel):
        raise TypeError("step_in_backward: DistributedDataParallel all-reduces gradients after the per-parameter "
                        "hook has already stepped; not supported")
    if isinstance(model_or_params, nn.Module):
        items = list(model_or_params.parameters())
    elif isinstance(model_or_params, torch.Tensor):
        raise TypeError("step_in_backward: pass a model or an iterable of parameters, not one tensor")
    else:
        items = list(model_or_params)
    unique = list({id(p): p for p in items}.values())   # tied weights once
    if not unique:
        raise ValueError("step_in_backward: no parameters")
    for p in unique:
        if not isinstance(p, torch.Tensor) or not p.is_leaf:
            raise TypeError("step_in_backward: every parameter must be a leaf tensor (an nn.Parameter)")
    return unique


class _GradReadyHook:
    """A parameter's post-accumulate-grad hook, holding its optimizer weakly. A strong reference would close a
    cycle through the tensor's C++ hook table (parameter -> hook -> optimizer -> parameter) that Python's
    garbage collector cannot see: model and optimizer would stay allocated for the life of the process."""

    def __init__(self, optimizer: "InBackwardOptimizer"):
        self.optimizer = weakref.ref(optimizer)

    def __call__(self, p) -> None:
        optimizer = self.optimizer()
        if optimizer is not None:
            optimizer._on_grad_ready(p)


def _remove_handles(handles) -> None:
    for h in handles:
        h.remove()


class InBackwardOptimizer(torch.optim.Optimizer):
    """One ``optimizer_class([p], **kwargs)`` per parameter, stepped from the parameter's post-accumulate-grad
    hook (see the module docstring). ``step()`` ends the training step."""

    def __init__(self, params, optimizer_class, kwargs: dict):
        self._ready = False
        params = list(params)
        self.optimizers = OrderedDict((p, optimizer_class([p], **kwargs)) for p in params)
        super().__init__(params, {})
        first = next(iter(self.optimizers.values()))
        self.defaults = first.defaults
        self.param_groups = [opt.param_groups[0] for opt in self.optimizers.values()]
        self.state = PerParamState(self.optimizers)
        self.optimizer_class = optimizer_class
        self._param_pre_hooks: OrderedDict = OrderedDict()
        self._param_post_hooks: OrderedDict = OrderedDict()
        self._grad_hooks = [self._register_grad_hook(p) for p in params]
        weakref.finalize(self, _remove_handles, list(self._grad_hooks))   # no hook outlives its optimizer
        self.param_steps = 0       # per-parameter steps taken (in backward or by step())
        self._ready = True

    def _register_grad_hook(self, p):
        """The hook on ``p``; a parameter frozen right now is unfrozen for the registration only (the
        hook stays when requires_grad flips)."""
        frozen = not p.requires_grad
        if frozen:
            p.requires_grad_(True)
        try:
            return p.register_post_accumulate_grad_hook(_GradReadyHook(self))
        finally:
            if frozen:
                p.requires_grad_(False)

    @torch.no_grad()
    def _step_param(self, p) -> None:
        for hook in list(self._param_pre_hooks.values()):
            hook(p)
        self.optimizers[p].step()
        p.grad = None
        self.param_steps += 1
        for hook in list(self._param_post_hooks.values()):
            hook(p)

    def _on_grad_ready(self, p) -> None:
        if p.grad is not None:
            self._step_param(p)

    def register_param_step_pre_hook(self, hook) -> RemovableHandle:
        """``hook(p)`` right before parameter ``p`` steps (FrozenState waits there for its state's copy back)."""
        handle = RemovableHandle(self._param_pre_hooks)
        self._param_pre_hooks[handle.id] = hook
        return handle

    def register_param_step_post_hook(self, hook) -> RemovableHandle:
        """``hook(p)`` right after parameter ``p`` stepped (FrozenState(between_steps=True) holds its state)."""
        handle = RemovableHandle(self._param_post_hooks)
        self._param_post_hooks[handle.id] = hook
        return handle

    @torch.no_grad()
    def step(self, closure=None):
        """End of the training step (the updates happened in backward); runs the step hooks. A parameter that
        still holds a gradient (set by hand, or the scheduler's experimental zero gradients) steps now."""
        if closure is not None:
            raise ValueError("step_in_backward: closures are not supported (the step happens inside backward)")
        for p in list(self.optimizers):
            if p.grad is not None:
                self._step_param(p)
        return None

    def add_param_group(self, param_group) -> None:
        if self._ready:
            raise NotImplementedError("step_in_backward: parameters cannot be added later; build it over all of "
                                      "the model's parameters (frozen ones are skipped while they are frozen)")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict) -> None:
        """As for one optimizer with one group per parameter; the loaded state and groups go to each
        parameter's own optimizer."""
        super().load_state_dict(state_dict)
        loaded_state, loaded_groups = self.state, self.param_groups
        for (p, opt), group in zip(self.optimizers.items(), loaded_groups):
            opt.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
            opt.state.pop(p, None)
            if p in loaded_state:
                opt.state[p] = loaded_state[p]
        self.param_groups = [opt.param_groups[0] for opt in self.optimizers.values()]
        self.state = PerParamState(self.optimizers)

    def clip_grad_norm_(self, *args, **kwargs):
        raise RuntimeError(_CLIPPING)

    def remove(self) -> None:
        """Remove the gradient hooks: backward leaves gradients for a plain loop again."""
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []


def step_in_backward(model_or_params, optimizer_class=torch.optim.AdamW, **kwargs) -> InBackwardOptimizer:
    """An InBackwardOptimizer: ``optimizer_class([p], **kwargs)`` for every parameter of ``model_or_params``
    (a module or an iterable of parameters; tied weights once), each stepped inside backward. Works with
    torch optimizers (AdamW with foreach or fused), torchao's and bitsandbytes' 8-bit AdamW. Clipping options
    are refused (a ValueError with the reason): there is no total norm in this mode."""
    clipping = [k for k in kwargs if k in CLIPPING_OPTIONS]
    if clipping:
        raise ValueError(f"step_in_backward({clipping[0]}=...): {_CLIPPING}")
    if not isinstance(optimizer_class, type) or not issubclass(optimizer_class, torch.optim.Optimizer):
        raise TypeError(f"step_in_backward: optimizer_class must be a torch.optim.Optimizer subclass (e.g. "
                        f"torch.optim.AdamW), got {optimizer_class!r}")
    return InBackwardOptimizer(_parameters(model_or_params), optimizer_class, kwargs)
