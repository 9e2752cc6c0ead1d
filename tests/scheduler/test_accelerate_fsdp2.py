"""accelerate's FSDP2 plugin on two CPU processes over gloo: a tiny Llama prepared by ``Accelerator.prepare``
(accelerate's own fully_shard path, forced on the CPU: see _accelerate_fsdp2_worker.py) trains under
slimfit's defaults with every saving of the optimizer side on (the chunked step on the shards, every moment
held 8-bit), makes the same decisions on both ranks, and ends on the weights of the same model sharded by
hand, bit for bit (against one process: test_fsdp2_equivalence.py). The HF Trainer with ``fsdp`` configured
(version 2) and SlimFitCallback the same."""

import pytest
import torch
import torch.distributed as dist
from _two_ranks import run_two_ranks

pytest.importorskip("accelerate")
pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is needed")

STEPS = 4


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import _accelerate_fsdp2_worker

    return run_two_ranks(_accelerate_fsdp2_worker.run, tmp_path_factory.mktemp("accelerate_fsdp2"), STEPS,
                         "accelerate FSDP2")


def test_the_defaults_keep_every_saving_under_accelerates_fsdp2(ranks):
    for r in ranks:
        a = r["accelerated"]
        assert a["optimizer"] == "AcceleratedOptimizer" and a["dtensor"]
        assert a["chunked"] and a["between_steps"]          # stepped on the shards, every moment held
        assert a["held"] > 0 and a["in_full"] == a["cut"] and len(a["cut"]) < len(a["weights"]) / 2
        assert a["losses"][-1] < a["losses"][0]


def test_both_ranks_decide_alike_and_end_on_the_same_weights(ranks):
    a0, a1 = ranks[0]["accelerated"], ranks[1]["accelerated"]
    assert a0["log"] == a1["log"] and len(set(a0["log"])) > 1
    for name, w in a0["weights"].items():
        assert torch.equal(w, a1["weights"][name]), name


def test_accelerate_trains_as_the_model_sharded_by_hand(ranks):
    for r in ranks:
        a, hand = r["accelerated"], r["by_hand"]
        assert a["log"] == hand["log"] and a["losses"] == hand["losses"]
        for name, w in a["weights"].items():
            assert torch.equal(w, hand["weights"][name]), name


@pytest.fixture(scope="module")
def trainer_ranks(tmp_path_factory):
    import _accelerate_fsdp2_worker

    return run_two_ranks(_accelerate_fsdp2_worker.run_trainer, tmp_path_factory.mktemp("trainer_fsdp2"), STEPS,
                         "Trainer FSDP2")


def test_the_trainer_with_fsdp_and_the_callback_keeps_every_saving(trainer_ranks):
    """Under the Trainer's gradient clipping (max_grad_norm=1.0): the chunked step takes the clipped shards."""
    t0, t1 = trainer_ranks
    for t in trainer_ranks:
        assert t["dtensor"] and t["chunked"] and t["between_steps"]
        assert t["held"] > 0 and t["in_full"] == t["cut"]
        assert len(t["logged"]) == STEPS and all(share > 0 for share in t["logged"])
        assert t["moved"]
    for name, w in t0["weights"].items():
        assert torch.equal(w, t1["weights"][name]), name
