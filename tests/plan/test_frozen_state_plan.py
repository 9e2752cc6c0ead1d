"""The plan with the scheduler's frozen_state: predicted as measured on the CPU (8-bit moments; offload, which
saves nothing there), the offload taken off a CUDA step's device, the code it prints, the spec's checks."""
from __future__ import annotations

import pytest

from slimfit.memory.plan.code import render
from slimfit.plan import StepSpec, measure, predict

SPEC = StepSpec("bert-tiny", batch=4, seq=64, preset="paper", rate=0.5, frozen_state=None)


@pytest.mark.parametrize("mode", ["compress", "offload", "compress_all"])
def test_prediction_equals_the_measured_step(mode):
    spec = SPEC.replace(frozen_state=mode)
    predicted, measured = predict(spec), measure(spec)
    assert predicted.total == measured.total
    assert predicted.memory.optimizer_state == measured.optimizer_state


def test_compressed_state_takes_the_frozen_layers_moments_down_and_offload_on_a_cpu_does_not():
    full, comp, off = (predict(SPEC.replace(frozen_state=m)) for m in (None, "compress", "offload"))
    assert comp.frozen_layers == full.frozen_layers > 0
    assert comp.memory.optimizer_state < full.memory.optimizer_state < 1.5 * full.memory.optimizer_state
    assert off.memory.optimizer_state == full.memory.optimizer_state and off.total == full.total


def test_every_state_8_bit_holds_the_trained_layers_moments_too():
    comp, every = (predict(SPEC.replace(frozen_state=m)) for m in ("compress", "compress_all"))
    assert every.memory.optimizer_state < comp.memory.optimizer_state and every.total < comp.total
    assert "every state 8-bit" in SPEC.replace(frozen_state="compress_all").label()


def test_offload_of_a_cuda_step_leaves_the_device():
    """On a GPU the host copies are not device memory: the prediction counts the frozen layers' moments out,
    as the H200 measured (tests/optim/test_optim_cuda.py)."""
    cuda = SPEC.replace(device="cuda")
    full, off = predict(cuda), predict(cuda.replace(frozen_state="offload"))
    comp = predict(cuda.replace(frozen_state="compress"))
    assert off.memory.optimizer_state < comp.memory.optimizer_state < full.memory.optimizer_state
    assert off.total < full.total


def test_the_printed_code_asks_the_scheduler_for_it():
    code = render(predict(SPEC.replace(frozen_state="compress")))
    assert "ILSScheduler(model, freeze_rate=0.5, optimizer=optimizer, optimizer_state='8bit-frozen')" in code
    assert "optimizer_state='full')" in render(predict(SPEC))   # frozen_state=None, by its canonical name
    assert "ILSScheduler(model, freeze_rate=0.5, optimizer=optimizer)" in render(predict(SPEC.replace(
        frozen_state="auto")))


def test_the_default_is_the_schedulers():
    """StepSpec's default is the scheduler's, "auto": every state 8-bit with AdamW (the chunked step holds it),
    nothing held with torchao's 8-bit AdamW or without a rate."""
    spec = StepSpec("bert-tiny", batch=4, seq=64, preset="paper", rate=0.5)
    assert spec.frozen_state == "auto" and spec.held_state == "compress_all"
    assert predict(spec).total == predict(spec.replace(frozen_state="compress_all")).total
    assert spec.replace(rate=0.0).held_state is None and spec.replace(optimizer="adamw8bit").held_state is None


@pytest.mark.parametrize("changes,message", [
    (dict(rate=0.0), "needs a freeze rate"),
    (dict(optimizer="adamw8bit"), "optimizer adamw"),
    (dict(frozen_state="bogus"), "must be 'auto', None, 'compress', 'offload' or 'compress_all'"),
])
def test_spec_refuses_what_cannot_hold_the_state(changes, message):
    with pytest.raises(ValueError, match=message):
        SPEC.replace(frozen_state="compress", **changes) if "frozen_state" not in changes else SPEC.replace(**changes)


@pytest.mark.parametrize("mode", ["compress", "offload", "compress_all"])
def test_the_later_steps_bound_counts_what_a_thawed_layer_brings_back(mode):
    """rate_bound adds, per trained layer, the state it gets back in full: for offload on a GPU all of it
    (the host copy was off the device), so the bound stays above the first set's peak."""
    from slimfit.plan import rate_bound

    spec = SPEC.replace(device="cuda", frozen_state=mode)
    assert rate_bound(spec) >= predict(spec).total
