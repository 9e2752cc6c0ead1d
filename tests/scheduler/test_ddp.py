"""DistributedDataParallel on two CPU processes over gloo: same decisions on every rank."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from _two_ranks import run_two_ranks
from slimfit.scheduler import ILSScheduler

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is needed")

STEPS = 8


def test_two_ranks_same_frozen_sets_and_weights_in_sync(tmp_path):
    import _ddp_worker

    r0, r1 = run_two_ranks(_ddp_worker.run, tmp_path, STEPS, "DDP")
    assert r0["names"] == r1["names"] and "module." not in r0["names"][0]
    assert len(r0["log"]) == STEPS and r0["log"] == r1["log"]      # same frozen set every step
    assert all(len(f) == 3 for f in r0["log"])                       # round(0.6 * 5)
    assert len(set(r0["log"])) > 1                                   # and it changed over time
    assert r0["scores"] == r1["scores"]                               # bit-identical scores
    for r in (r0, r1):
        assert r["in_sync"] and r["frozen_still"]
        errs = r["errors"]
        assert "find_unused_parameters=True" in errs["{'find_unused_parameters': False}"]
        assert "static_graph" in errs["{'find_unused_parameters': True, 'static_graph': True}"]
        assert "FSDP" in errs["fsdp"] or errs["fsdp"].startswith("unavailable")


def test_flat_parameters_are_refused():
    class FlatParameter(nn.Parameter):               # stands in for FSDP1's flattened parameter
        pass

    m = nn.Linear(4, 4)
    m.weight = FlatParameter(torch.randn(4, 4))
    with pytest.raises(NotImplementedError, match="FSDP"):
        ILSScheduler(m)
