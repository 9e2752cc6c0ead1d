"""Body of the two-process FSDP2 test (imported by spawned processes)."""
import os

import torch
import torch.distributed as dist
from _models import MLP, regression_data
from _two_ranks import init_worker


def run(rank, world, port, outdir, steps):
    init_worker(rank, world, port)
    try:
        _body(rank, outdir, steps)
    finally:
        dist.destroy_process_group()


def _full(sched):
    return {n: p.detach().full_tensor().clone() for n, p in zip(sched.names, sched.params)}


def _body(rank, outdir, steps):
    from torch.distributed.fsdp import fully_shard

    from slimfit.scheduler import ILSScheduler
    from slimfit.scheduler.scores import relative_scores_naive

    torch.manual_seed(0)                            # FSDP2 does not broadcast: same init on every rank
    model = MLP()
    for layer in (model.fc1, model.fc2, model.head):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # update_scale="none": the scores are compared with the whole tensors' unstretched update (the stretch's own
    # rounding is tested in test_in_step_scores.py and test_update_scale.py)
    # step_chunk_numel=None: torch's own step, so the layers are scored against snapshot shards (the path of an
    # optimizer the chunked step does not take; the chunked step's in-step sums: test_fsdp2_optimizer_side.py)
    sched = ILSScheduler(model, freeze_rate=0.6, optimizer=opt, seed=rank, update_scale="none",   # rank 0's seed
                         step_chunk_numel=None, warmup_steps=0)
    x, y = regression_data(seed=rank)               # each rank its own data
    log, frozen_still, score_errors = [], True, []
    for _ in range(steps):
        before = _full(sched)
        trained = sched.trained_names()
        log.append(tuple(sched.frozen_names()))
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        after = _full(sched)
        for n in sched.frozen_names():
            frozen_still &= torch.equal(before[n], after[n])
        sched.step()
        scores = sched.layer_scores()
        for n in trained:   # the scheduler's sharded score = the score of the whole tensors
            exact = relative_scores_naive(before[n], after[n])
            score_errors.append(abs(scores[n] - exact) / max(exact, 1e-30))
    torch.save({"log": log, "scores": sched.layer_scores(), "frozen_still": frozen_still,
                "score_err": max(score_errors), "weights": {k: v for k, v in _full(sched).items()},
                "sharded": sched._sharded}, os.path.join(outdir, f"rank{rank}.pt"))
