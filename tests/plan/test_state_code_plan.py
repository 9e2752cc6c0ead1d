"""StepSpec.state_code (slimfit plan --state-code): the scheduler's code of the held moments in the planned step,
predicted as measured; 4-bit moments hold about half the 8-bit ones' bytes; the spec's and the command's checks."""
from __future__ import annotations

import pytest

from slimfit.memory.plan.code import render
from slimfit.plan import StepSpec, measure, predict

SPEC = StepSpec("llama-tiny", batch=1, seq=16, preset="paper", rate=0.7)


def test_predicted_as_measured_and_four_bits_hold_half():
    spec = SPEC.replace(state_code="dynamic4")
    predicted, measured = predict(spec), measure(spec)
    assert predicted.total == measured.total
    eight = predict(SPEC)
    state4, state8 = predicted.memory.optimizer_state, eight.memory.optimizer_state
    assert 0.45 * state8 <= state4 <= 0.6 * state8, (state4, state8)
    assert "every state 4-bit" in spec.label() and "code dynamic4" in spec.label()
    assert "state_code='dynamic4'" in render(predicted)


@pytest.mark.parametrize("bad,match", [
    (dict(state_code="dynamic3"), "state_code must be one of"),
    (dict(state_code="dynamic4", rate=0.0), "needs a freeze rate"),
])
def test_bad_codes_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        SPEC.replace(**bad)


def test_the_command_takes_the_flag(capsys):
    from slimfit import cli

    assert cli.main(["plan", "llama-tiny", "--batch", "1", "--seq-len", "16", "--preset", "paper",
                     "--state-code", "dynamic4"]) == 0
    assert "every state 4-bit" in capsys.readouterr().out
