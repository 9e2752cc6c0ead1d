"""DistributedDataParallel on two CPU processes over gloo: same decisions on every rank."""
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from slimfit.scheduler import ILSScheduler

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is needed")

STEPS = 8


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_same_frozen_sets_and_weights_in_sync(tmp_path):
    import _ddp_worker

    ctx = mp.start_processes(_ddp_worker.run, args=(2, _free_port(), str(tmp_path), STEPS), nprocs=2,
                             join=False, start_method="spawn")
    deadline = time.time() + 240
    while not ctx.join(timeout=5):
        if time.time() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail("DDP workers did not finish in time (a collective mismatch would hang)")
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
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
