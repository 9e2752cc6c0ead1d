"""`slimfit plan --world-size N` / StepSpec(world_size=N): one rank of FSDP2 over N ranks predicted on fake
tensors with a fake process group (slimfit/memory/plan/sharding.py), gloo's reduce-scatter copy included on the
CPU; checked against two gloo ranks measured."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from slimfit import cli
from slimfit.plan import StepSpec, measure, predict

SPEC = StepSpec("bert-tiny", batch=2, seq=32, preset="paper", rate=0.5)


def test_world_size_is_checked():
    for bad in (0, -1, True, "2", 1.5):
        with pytest.raises(ValueError, match="world_size must be an int >= 1"):
            SPEC.replace(world_size=bad)


def test_a_rank_holds_its_pieces_of_the_weights_and_the_state():
    one, two = predict(SPEC).memory, predict(SPEC.replace(world_size=2)).memory
    assert 0.45 * one.weights <= two.weights <= 0.6 * one.weights           # dim-0 pieces, the first the larger
    assert 0.45 * one.optimizer_state <= two.optimizer_state <= 0.65 * one.optimizer_state
    assert not dist.is_initialized()                                      # the fake group is gone after


def test_a_sharded_step_is_predicted_only():
    with pytest.raises(ValueError, match="bench.sharded"):
        measure(SPEC.replace(world_size=2))


def test_cli_says_what_a_sharded_prediction_is_and_refuses_to_fit(capsys):
    assert cli.main(["plan", "bert-tiny", "--batch", "2", "--seq", "32", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "FSDP2 rank of 2" in out and "FSDP2: rank 0 of 2" in out and "gloo" in out
    assert cli.main(["plan", "bert-tiny", "--batch", "2", "--seq", "32", "--world-size", "2", "--fit", "1GiB"]) == 2
    assert "measure it" in capsys.readouterr().err


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="gloo is needed")
@pytest.mark.parametrize("method", ["fsdp2", "fsdp2+slimfit"])
def test_the_prediction_is_within_5_percent_of_every_measured_rank(method):
    """Two gloo processes (bench/sharded.py, a 2-layer BERT-base at batch 2, seq 32): every rank's measured peak
    within 5% of the prediction (measured: 480.92 MiB both for plain FSDP2, 352.31 against 352.30 for the
    defaults). Without gloo's copy in the plan plain FSDP2 is 3.9% under, its peak at that copy."""
    from bench import sharded

    row = sharded.measure_row(sharded.Spec("bert-16", "bert-base", 2, 32, 2, method, True))
    assert row["status"] == "ok", row["status"]
    predicted = sharded.predicted_mib(row, quick=True)
    for measured in (float(v) for v in row["rank_peaks_mib"].split()):
        assert abs(predicted / measured - 1) <= 0.05, (predicted, measured)


def test_the_cpu_plan_holds_gloo_reduce_scatter_copy(monkeypatch):
    """Plain FSDP2 on a 2-layer BERT-base peaks at the root's reduce-scatter, where gloo holds a copy of its input
    (the word embeddings' gradient and the rest of the root's, 93.2 MiB): planned without that copy, 19.0 MiB less."""
    from slimfit.memory.plan import sharding

    spec = StepSpec("bert-base", batch=2, seq=32, world_size=2, layers=2)
    with_copy = predict(spec).memory.total
    monkeypatch.setattr(sharding, "_is_fake", lambda mesh: False)   # the plan's own reduce-scatter off
    without = predict(spec).memory.total
    assert 18 * 2**20 < with_copy - without < 20 * 2**20
