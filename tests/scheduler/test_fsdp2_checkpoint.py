"""torch.distributed.checkpoint with the defaults under FSDP2: held 8-bit moments and the scheduler's state
saved by two gloo processes, loaded by one. A layer's moments come back exactly, frozen layers' included
(inside ``every_layer_trainable``: DCP saves and loads the state of parameters that require grad only), and
held again they decode to the same values wherever the blocks are the whole parameter's."""

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is needed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import _fsdp2_checkpoint_worker as w

    outdir = str(tmp_path_factory.mktemp("fsdp2_dcp"))
    saved = w.spawn(2, outdir, "save")
    return saved, w.spawn(1, outdir, "load")[0], w.spawn(1, outdir, "bare")[0]


def test_every_moment_comes_back_exactly_at_another_world_size(runs):
    saved, loaded, _ = runs
    assert saved[0]["frozen"] and loaded["frozen"] == saved[0]["frozen"]   # frozen layers while loading
    for key, (value, _) in saved[0]["moments"].items():
        assert torch.equal(loaded["loaded"][key], value), key


def test_held_again_the_moments_decode_the_same_where_blocks_are_the_whole_parameters(runs):
    saved, loaded, _ = runs
    held_both = 0
    for key, (value, held) in saved[0]["moments"].items():
        again, held_now = loaded["held_again"][key]
        assert held_now, key                                # one process holds every moment 8-bit
        if held:                                            # held at two ranks too: the same blocks
            assert torch.equal(again, value), key
            held_both += 1
    assert held_both >= 4    # fc1.weight and fc2.weight's two moments (rows of a multiple of 128 elements)
    kept_full = [k for k, (_, held) in saved[0]["moments"].items() if not held]
    assert ("ln1.weight", "exp_avg") in kept_full           # 32 elements cut in two: in full under sharding


def test_without_every_layer_trainable_dcp_drops_the_frozen_layers_moments(runs):
    """torch's behaviour, the reason for the context: a parameter that does not require grad has its saved
    state skipped at load."""
    saved, _, bare = runs
    frozen = set(saved[0]["frozen"])
    for (name, key), value in bare["loaded"].items():
        if name in frozen:
            assert value is None or not torch.equal(value, saved[0]["moments"][(name, key)][0]), name


@pytest.mark.slow
def test_four_ranks_to_two_to_one(tmp_path):
    """4 -> 2 -> 1 (the 4-process case is slow: python -m pytest -m slow): every moment the four ranks saved
    comes back exactly after two reshards, and held again decodes the same where four ranks held it."""
    import _fsdp2_checkpoint_worker as w

    saved = w.spawn(4, str(tmp_path), "save")
    w.spawn(2, str(tmp_path), "relay")
    last = w.spawn(1, str(tmp_path), "last")[0]
    held_both = 0
    for key, (value, held) in saved[0]["moments"].items():
        assert torch.equal(last["loaded"][key], value), key
        if held:
            assert torch.equal(last["held_again"][key][0], value), key
            held_both += 1
    assert held_both >= 2    # fc2.weight's two moments: 8 rows of 32 a rank
