"""StepSpec.scheduled_kinds (slimfit plan --scheduled-kinds): the scheduler's scheduled_kinds in the planned step,
predicted as measured; the embeddings scheduled too take their gradient and moments out of the frozen part;
the spec's and the command's checks."""
from __future__ import annotations

import pytest

from slimfit.memory.plan.code import render
from slimfit.plan import StepSpec, measure, predict

SPEC = StepSpec("llama-tiny", batch=1, seq=16, preset="paper", rate=0.7)


def test_predicted_as_measured_and_the_scheduled_embeddings_freeze():
    kinds = ("matmul", "embedding")
    spec = SPEC.replace(scheduled_kinds=kinds)
    predicted, measured = predict(spec), measure(spec)
    assert predicted.total == measured.total
    default = predict(SPEC)
    assert predicted.layers > default.layers   # the embedding (tied with the head) is scheduled too
    assert "scheduled: matmul + embedding" in spec.label()
    assert "scheduled_kinds=('matmul', 'embedding')" in render(predicted)


@pytest.mark.parametrize("bad,match", [
    (dict(scheduled_kinds=("matmul", "embeding")), "embedding"),     # the scheduler's own did-you-mean
    (dict(scheduled_kinds=("matmul",), rate=0.0), "needs a freeze rate"),
])
def test_bad_kinds_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        SPEC.replace(**bad)


def test_the_command_takes_the_flag(capsys):
    from slimfit import cli

    assert cli.main(["plan", "llama-tiny", "--batch", "1", "--seq-len", "16", "--preset", "paper",
                     "--scheduled-kinds", "matmul,embedding"]) == 0
    assert "scheduled: matmul + embedding" in capsys.readouterr().out
