"""DistributedDataParallel on two CPU processes over gloo: same decisions on every rank."""
import pytest
import torch
import torch.distributed as dist
from _two_ranks import run_two_ranks
from torch import nn

from slimfit.scheduler import ILSScheduler

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is needed")

STEPS = 8


def test_two_ranks_same_frozen_sets_and_weights_in_sync(tmp_path):
    import _ddp_worker

    r0, r1 = run_two_ranks(_ddp_worker.run, tmp_path, STEPS, "DDP")
    assert r0["names"] == r1["names"] and "module." not in r0["names"][0]
    assert len(r0["log"]) == STEPS and r0["log"] == r1["log"]      # same frozen set every step
    assert all(len(f) == 2 for f in r0["log"])                       # round(0.6 * 3): MLP's weight matrices
    assert len(set(r0["log"])) > 1                                   # and it changed over time
    assert r0["scores"] == r1["scores"]                               # bit-identical scores
    for r in (r0, r1):
        assert r["in_sync"] and r["frozen_still"]


def _ddp_shell(**settings):
    """A DistributedDataParallel object with the given settings and no process group: the scheduler
    only reads them. (Real DDP objects built only to be refused left gloo threads behind that
    aborted the worker at exit now and then.)"""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP.__new__(DDP)
    nn.Module.__init__(ddp)
    ddp.module = nn.Linear(4, 4)
    ddp.find_unused_parameters = settings.get("find_unused_parameters", True)
    ddp.static_graph = settings.get("static_graph", False)
    return ddp


def test_ddp_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="find_unused_parameters=True"):
        ILSScheduler(_ddp_shell(find_unused_parameters=False), freeze_rate=0.6)
    with pytest.raises(ValueError, match="static_graph"):
        ILSScheduler(_ddp_shell(static_graph=True), freeze_rate=0.6)
    ILSScheduler(_ddp_shell(), freeze_rate=0.6)   # the settings DDP needs


def test_flat_parameters_are_refused():
    class FlatParameter(nn.Parameter):               # stands in for FSDP1's flattened parameter
        pass

    m = nn.Linear(4, 4)
    m.weight = FlatParameter(torch.randn(4, 4))
    with pytest.raises(NotImplementedError, match="FSDP"):
        ILSScheduler(m)
