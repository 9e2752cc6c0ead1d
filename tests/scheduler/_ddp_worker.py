"""Body of the two-process DDP test (imported by spawned processes)."""
import os

import torch
import torch.distributed as dist
from _models import MLP, regression_data
from _two_ranks import init_worker
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def run(rank, world, port, outdir, steps):
    init_worker(rank, world, port)
    try:
        _body(rank, world, outdir, steps)
    finally:
        dist.destroy_process_group()


def _body(rank, world, outdir, steps):
    from slimfit.scheduler import ILSScheduler

    torch.manual_seed(rank)                         # different init: DDP broadcasts rank 0's
    model = MLP()
    ddp = DDP(model, find_unused_parameters=True)   # DDP first, then the scheduler
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    # rank 0's seed wins, for the schedule and for the frozen state's rounding (replicas stay equal)
    sched = ILSScheduler(ddp, freeze_rate=0.6, optimizer=opt, seed=rank, frozen_state="compress", warmup_steps=0)
    cand = dict(zip(sched.names, sched.params))
    log, in_sync, frozen_still = [], True, True
    for step in range(steps):
        frozen = sched.frozen_names()
        log.append(tuple(frozen))
        before = {n: cand[n].detach().clone() for n in frozen}
        x, y = regression_data(n=32, seed=1000 * rank + step)   # different data on each rank
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=(step % 2 == 0))
        frozen_still &= all(torch.equal(before[n], cand[n]) for n in frozen)
        sched.step()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        in_sync &= all(torch.equal(g, gathered[0]) for g in gathered)
    torch.save({"log": log, "scores": sched.layer_scores(), "in_sync": in_sync,
                "frozen_still": frozen_still, "names": sched.names},
               os.path.join(outdir, f"rank{rank}.pt"))
