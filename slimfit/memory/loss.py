"""The loss a measured step runs backward on, one policy for every measurement (saved bytes and the step peak).

`loss_fn(output)` when given, else the output's own `loss` (a Hugging Face model called with labels), else the
output itself when it is a one-element tensor. Anything else is refused, never made up: backward on a sum of
outputs is a step no training loop runs, and the bytes the real loss keeps (a cross-entropy keeps its
probabilities, as large as the logits) would be missing from a number reported as a training step. The error
names the fix; a caller that wants the sum passes `loss_fn=lambda out: out.sum()`, which says so.
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["NoLossError", "training_loss"]


class NoLossError(ValueError, TypeError):
    """The measured step's output gives no loss to run backward on (a ValueError, and a TypeError for callers
    that catch a wrong kind of output)."""


def describe(out) -> str:
    """A few words on what a forward returned, for an error message."""
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)}"
    if isinstance(out, (list, tuple)):
        return f"a {type(out).__name__} of {len(out)} items"
    if isinstance(out, dict):
        return f"a {type(out).__name__} with keys {list(out)[:6]}"
    return f"a {type(out).__name__}"


def _output_loss(out):
    """(the output's own loss, how it was found) or (None, None) when it has none."""
    if isinstance(out, dict) and "loss" in out:
        return out["loss"], "output.loss"
    if hasattr(out, "loss"):
        return out.loss, "output.loss"
    return None, None


def training_loss(out, loss_fn: Callable | None, *, who: str, fix: str) -> torch.Tensor:
    """The one-element floating loss of `out` that requires grad (module docstring). `who` names the caller in
    the error, `fix` says what to pass instead; NoLossError (a ValueError) for anything else."""
    if loss_fn is not None:
        loss, what = loss_fn(out), "loss_fn(output)"
    else:
        loss, what = _output_loss(out)
        if what is not None and loss is None:
            raise NoLossError(
                f"{who}: {what} is None: the model computed no loss (a Hugging Face model called without labels), "
                f"so backward cannot run and the bytes its loss keeps are not counted; {fix}")
        if what is None and isinstance(out, torch.Tensor) and out.numel() == 1:
            loss, what = out, "the output"
        elif what is None:
            raise NoLossError(f"{who}: the output ({describe(out)}) has no loss to run backward on, and summing "
                              f"the outputs would make one up (the bytes the real loss keeps would be missing); {fix}")
    if not isinstance(loss, torch.Tensor) or not loss.is_floating_point() or loss.numel() != 1:
        raise NoLossError(f"{who}: {what} must be a one-element floating tensor (the loss), got {describe(loss)}; "
                          f"{fix}")
    if not loss.requires_grad:
        raise NoLossError(
            f"{who}: {what} does not require grad (nothing in the measured step trains, or it ran under "
            f"torch.no_grad), so there is no backward to run; make a parameter or an input require grad; else {fix}")
    return loss
