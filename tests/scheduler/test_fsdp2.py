"""FSDP2 (fully_shard) on two CPU processes over gloo: the scheduler scores sharded layers from
per-shard sums and makes the same decision on every rank."""

import pytest
import torch
import torch.distributed as dist
from _two_ranks import run_two_ranks

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is needed")

STEPS = 6


def test_two_ranks_fsdp2_same_decisions_and_whole_tensor_scores(tmp_path):
    import _fsdp2_worker

    r0, r1 = run_two_ranks(_fsdp2_worker.run, tmp_path, STEPS, "FSDP2")
    assert r0["sharded"] and r1["sharded"]
    assert len(r0["log"]) == STEPS and r0["log"] == r1["log"]          # same frozen set every step
    assert len({len(f) for f in r0["log"]}) == 1 and len(set(r0["log"])) > 1   # 3 of 5 frozen, set changes
    assert r0["scores"] == r1["scores"]
    assert r0["frozen_still"] and r1["frozen_still"]                  # frozen shards did not move
    assert r0["score_err"] < 1e-9 and r1["score_err"] < 1e-9           # = the score of the whole tensor
    for name, w in r0["weights"].items():                              # gradients reduced: replicas agree
        assert torch.equal(w, r1["weights"][name]), name
