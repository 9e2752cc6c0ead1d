"""What the optimizer step in backward saves, measured by slimfit.step_memory.measure_step.

A plain loop holds every gradient at the optimizer step (and foreach AdamW adds temporaries the size of all of
them); in backward, one parameter's gradient and that parameter's temporaries are alive at a time. The bound
checked: the step's peak above what was resident at entry is at most 4 parameter-sizes of the largest
parameter (its gradient plus at most 2 temporaries of the for-loop AdamW, 1 of foreach, 0 of fused, and one
to spare) plus the forward's activations.
"""
import pytest
import torch
from _optim_models import build, data, loss_of, train

from slimfit.optim import step_in_backward
from slimfit.step_memory import measure_step


def _measured(in_backward: bool, kwargs: dict):
    batch = data(n=4)
    model = build(0, d=512, depth=6)
    opt = (step_in_backward(model, torch.optim.AdamW, lr=1e-3, **kwargs) if in_backward
           else torch.optim.AdamW(model.parameters(), lr=1e-3, **kwargs))
    train(model, opt, batch, 1, schedule=None)   # the state exists: a steady-state step is measured
    return measure_step(model, lambda: loss_of(model, batch), opt), model


@pytest.mark.parametrize("kwargs", [{"foreach": True}, {"foreach": False}, {"fused": True}],
                         ids=["foreach", "for-loop", "fused"])
def test_step_peak_holds_one_parameter_at_a_time(kwargs):
    plain, model = _measured(False, kwargs)
    inbw, _ = _measured(True, kwargs)
    grads = sum(4 * p.numel() for p in model.parameters())
    largest = max(4 * p.numel() for p in model.parameters())
    activations = plain.phase_peaks["forward"] - plain.phase_peaks["entry"]
    assert inbw.resident == plain.resident                      # weights and AdamW state, nothing else
    assert inbw.total - inbw.resident <= 4 * largest + activations
    assert plain.total - inbw.total >= grads - 2 * largest      # the gradients never alive together
    if kwargs.get("foreach"):
        assert plain.peak_phase == "optimizer" and plain.gradients == grads
        assert plain.transient >= grads                          # foreach: temporaries over every parameter
        # in backward: over one. Its gradient counts as transient (the step frees it before measure_step's own
        # post-accumulate-grad hook, registered later, can mark it as a gradient).
        assert inbw.gradients == 0 and inbw.transient <= 2 * largest + activations
