"""Body of the FSDP2 world-size equivalence tests (imported by spawned processes): a tiny Llama and a tiny BERT
sharded over N ranks (fully_shard on each layer and the root) under the scheduler with the moments in full (the
chunked step on the shards, scores summed over them), against one process on every rank's batch together."""
import copy
import os

import torch
import torch.distributed as dist
from _models import bert_batch, tiny_bert, tiny_llama
from _two_ranks import init_worker

LR = 1e-3


def run(rank, world, port, outdir, steps):
    init_worker(rank, world, port)
    try:
        out = {kind: _compare(kind, rank, world, steps) for kind in ("llama", "bert")}
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _batch(kind, rank):
    """A rank's own batch: 2 rows, every label counted (the ranks' mean loss is the union's mean)."""
    if kind == "bert":
        return bert_batch(n=2, seq=12, seed=rank)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(rank))
    return {"input_ids": ids, "labels": ids}


def _sharded(model, kind):
    from torch.distributed.fsdp import fully_shard

    for layer in (model.model.layers if kind == "llama" else model.bert.encoder.layer):
        fully_shard(layer)
    return fully_shard(model)


def _compare(kind, rank, world, steps):
    from slimfit.scheduler import ILSScheduler

    base = tiny_llama() if kind == "llama" else tiny_bert(seed=0)
    union = {k: torch.cat([_batch(kind, r)[k] for r in range(world)]) for k in _batch(kind, 0)}
    out = {}
    for name, model, batch, distributed in (("shards", _sharded(copy.deepcopy(base), kind), _batch(kind, rank), True),
                                            ("one", copy.deepcopy(base), union, False)):
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, seed=0, warmup_steps=0, optimizer_state="full",
                             distributed=distributed)
        log = []
        for _ in range(steps):
            log.append(tuple(sched.frozen_names()))
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        out[name] = {"log": log, "in_step": sched.chunked_step is not None and sched.chunked_step.pieces_stepped > 0,
                     "weights": {n: (p.detach().full_tensor() if distributed else p.detach()).clone()
                                 for n, p in model.named_parameters()}}
        sched.close()
    return out
