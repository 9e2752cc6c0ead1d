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


DECODER = StepSpec("smollm2-135m", batch=1, seq=64, layers=2, preset="paper", rate=0.5)
# When every scheduled layer trains (the ramp's first step) or the step is taken in backward, the measured step
# meets the scheduler's per-layer bookkeeping (5 host tensors of one entry per scheduled layer: 15 layers, 390
# bytes) where the fake run does not count it; everything else is exact.
_BOOKKEEPING = 26 * 15


@pytest.mark.parametrize("changes", [dict(step_in_backward=True), dict(step_in_backward=True, optimizer_state="host"),
                                     dict(preset="none", rate=0.0, chunked_loss=True, checkpointing=True,
                                          step_in_backward=True)],
                         ids=["in-backward", "host", "recipe"])
def test_step_in_backward_and_the_chunked_loss_predicted_as_measured(changes):
    spec = DECODER.replace(**changes)
    predicted, measured = predict(spec), measure(spec)
    assert 0 <= measured.total - predicted.total <= _BOOKKEEPING if spec.rate else measured.total == predicted.total
    assert predicted.memory.optimizer_state == measured.optimizer_state


def test_the_step_in_backward_frees_the_gradients_and_the_chunked_loss_the_logits():
    plain = DECODER.replace(preset="none", rate=0.0)
    in_backward, chunked = predict(plain.replace(step_in_backward=True)), predict(plain.replace(chunked_loss=True))
    base = predict(plain)
    assert in_backward.total < base.total   # no gradient of every parameter at the optimizer's peak
    # the logits (1 x 64 x 49,152 fp32) are never made whole: the forward's peak drops (the step's peak here is
    # the optimizer's, which the loss does not change)
    assert chunked.memory.phase_peaks["forward"] < base.memory.phase_peaks["forward"] - 10 * 2**20
    assert "step in backward" in plain.replace(step_in_backward=True).label()
    assert "chunked CE" in plain.replace(chunked_loss=True).label()
    with pytest.raises(ValueError, match="chunked_loss chunks a causal LM's loss"):
        predict(SPEC.replace(chunked_loss=True))


def test_every_state_on_the_host_leaves_a_cuda_steps_device():
    cuda = DECODER.replace(device="cuda", step_in_backward=True)
    every_8bit, host_frozen, host = (predict(cuda.replace(optimizer_state=m)) for m in ("8bit", "host-frozen", "host"))
    assert host.memory.optimizer_state < every_8bit.memory.optimizer_state
    assert host.memory.optimizer_state < host_frozen.memory.optimizer_state
    assert "every state on the host" in cuda.replace(optimizer_state="host").label()
    # streamed a piece at a time (optim/host_step.py): no parameter's moments come back whole, so the step's
    # peak is below every moment held 8-bit on the device (the 49k x 576 embedding's moments whole: above it)
    assert host.total < every_8bit.total
    # under a plain AdamW's chunked step too
    plain = DECODER.replace(device="cuda")
    plain_host, plain_8bit = (predict(plain.replace(optimizer_state=m)) for m in ("host", "8bit"))
    assert plain_host.memory.optimizer_state < plain_8bit.memory.optimizer_state
    assert plain_host.total < plain_8bit.total


def test_the_printed_code_steps_in_backward():
    spec = DECODER.replace(preset="none", rate=0.0, chunked_loss=True, step_in_backward=True)
    code = render(predict(spec))
    assert "optimizer = step_in_backward([p for p in model.parameters() if p.requires_grad], torch.optim.AdamW" \
        in code
    assert "lm_head_chunk_rows=256" in code


def test_the_ramps_first_step_is_predicted_as_measured_and_is_the_worst():
    """warmup_steps="auto" on a causal LM: the predicted step is the ramp's first (nothing frozen), above the
    frozen set at the rate (StepSpec's default, warmup_steps=0), and the prediction is the measured step."""
    at_rate = DECODER
    ramp = at_rate.replace(warmup_steps="auto")
    first, steady = predict(ramp), predict(at_rate)
    assert first.warmup_steps == 100 and first.frozen_layers == 0 and steady.frozen_layers > 0
    assert first.total > steady.total
    assert 0 <= measure(ramp).total - first.total <= _BOOKKEEPING
    assert "the first step of its ramp" in ramp.label()
    with pytest.raises(ValueError, match="warmup_steps must be 'auto' or an int"):
        DECODER.replace(warmup_steps=-1)
    assert "warmup_steps=0" in render(steady)   # a causal LM: the code asks for what was predicted
    assert "warmup_steps" not in render(predict(SPEC))   # an encoder: 0 is the scheduler's own default


@pytest.mark.parametrize("changes", [dict(rate=0.05), dict(rate=0.7, warmup_steps="auto")], ids=["low-rate", "ramp"])
def test_a_tiny_decoder_whose_every_matrix_trains_is_predicted_as_measured(changes):
    """llama-tiny's weight matrices are small enough (64 x 64) to be made for real in a fake run; with nearly every
    one trained, the chunked step updated real pieces beside fake moments, which the fake mode refused. Its
    parameters are made fake after the build (fake.fake_parameters)."""
    spec = StepSpec("llama-tiny", batch=1, seq=16, **changes)
    assert predict(spec).total == measure(spec).total
