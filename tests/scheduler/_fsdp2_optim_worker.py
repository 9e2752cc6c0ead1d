"""Body of the two-process FSDP2 optimizer-side tests (imported by spawned processes): the chunked step and
the held moments on sharded parameters, against torch's own step and against one process on the whole batch."""
import copy
import os

import torch
import torch.distributed as dist
from _models import MLP, regression_data
from _two_ranks import init_worker

from slimfit.optim.keys import HOST, Q8


def run(rank, world, port, outdir, steps):
    init_worker(rank, world, port)
    try:
        torch.save(_body(rank, world, steps), os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _sharded(model):
    from torch.distributed.fsdp import fully_shard

    for layer in (model.fc1, model.fc2, model.head):
        fully_shard(layer)
    return fully_shard(model)


def _local(model):
    return {n: p.detach().to_local().clone() for n, p in model.named_parameters()}


def _full(model):
    return {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}


def _train(model, opt, sched, x, y, steps):
    log, losses = [], []
    for _ in range(steps):
        if sched is not None:
            log.append(tuple(sched.frozen_names()))
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(float(loss))
    return log, losses


def _body(rank, world, steps):
    from slimfit.optim import attach_chunked_step
    from slimfit.optim.keys import Q8
    from slimfit.optim.sharded_params import blocks_fixed
    from slimfit.scheduler import ILSScheduler

    torch.manual_seed(0)                             # FSDP2 does not broadcast: the same init on every rank
    base = MLP()
    x, y = regression_data(n=64, seed=0)
    half = slice(rank * 32, (rank + 1) * 32)         # each rank half of one batch of 64
    out = {}

    # torch's own AdamW against the chunked step (pieces of 100 elements), both on sharded parameters
    plain, chunked = _sharded(copy.deepcopy(base)), _sharded(copy.deepcopy(base))
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    opt_chunked = torch.optim.AdamW(chunked.parameters(), lr=1e-2, weight_decay=0.1)
    step = attach_chunked_step(opt_chunked, chunk_numel=100)
    _train(plain, opt_plain, None, x[half], y[half], steps)
    _train(chunked, opt_chunked, None, x[half], y[half], steps)
    out["plain"], out["chunked"], out["pieces_stepped"] = _local(plain), _local(chunked), step.pieces_stepped
    out["measured"] = _measured(plain, opt_plain, x[half], y[half])
    out["chunked_state_is_dtensor"] = all(type(st["exp_avg"]).__name__ == "DTensor"
                                          for st in opt_chunked.state.values())

    # the step in backward on shards: each shard stepped as its reduced gradient lands; alone (torch's AdamW bit
    # for bit), and under the scheduler's defaults (every moment 8-bit, stepped a piece at a time per parameter)
    from slimfit.optim import step_in_backward

    sib = _sharded(copy.deepcopy(base))
    _train(sib, step_in_backward(sib, torch.optim.AdamW, lr=1e-2, weight_decay=0.1), None, x[half], y[half], steps)
    out["in_backward"] = _local(sib)
    sib = _sharded(copy.deepcopy(base))
    opt_sib = step_in_backward(sib, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    sched = ILSScheduler(sib, freeze_rate=0.6, optimizer=opt_sib, seed=0, warmup_steps=0)
    log, losses = _train(sib, opt_sib, sched, x[half], y[half], steps)
    out["in_backward_defaults"] = {"log": log, "losses": losses, "weights": _full(sib),
                                   "between_steps": sched.state_holder.between_steps,
                                   "held": sum(1 for st in opt_sib.state.values() for k in st if k.endswith(Q8))}
    sched.close()

    # gradient accumulation over two micro-batches and clip_grad_norm_, both ways
    plain, chunked = _sharded(copy.deepcopy(base)), _sharded(copy.deepcopy(base))
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    opt_chunked = torch.optim.AdamW(chunked.parameters(), lr=1e-2, weight_decay=0.1)
    step = attach_chunked_step(opt_chunked, chunk_numel=100)
    for model, opt in ((plain, opt_plain), (chunked, opt_chunked)):
        for _ in range(3):
            for micro in (slice(rank * 32, rank * 32 + 16), slice(rank * 32 + 16, (rank + 1) * 32)):
                (((model(x[micro]) - y[micro]) ** 2).mean() / 2).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
    out["accumulated_plain"], out["accumulated_chunked"] = _local(plain), _local(chunked)
    out["accumulated_pieces"] = step.pieces_stepped

    # bf16 weights: the defaults (every moment 8-bit, weights rounded stochastically) on shards
    model = _sharded(copy.deepcopy(base).to(torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = ILSScheduler(model, freeze_rate=0.6, optimizer=opt, seed=0)
    before = _local(model)
    _, losses = _train(model, opt, sched, x[half].bfloat16(), y[half].bfloat16(), steps)
    out["bf16"] = {"losses": losses, "rounding": sched.chunked_step.weight_rounding,
                   "unmoved": [n for n, w in _local(model).items() if w.numel() and torch.equal(w, before[n])]}

    # the scheduler with the chunked step, moments in full, against one process on the whole batch
    for name, state in (("full", "full"), ("q8", "8bit"), ("host", "host"), ("q8frozen", "8bit-frozen"),
                        ("hostfrozen", "host-frozen")):
        model = _sharded(copy.deepcopy(base))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        sched = ILSScheduler(model, freeze_rate=0.6, optimizer=opt, seed=0, update_scale="none",
                             optimizer_state=state, warmup_steps=0)
        log, losses = _train(model, opt, sched, x[half], y[half], steps)
        one = copy.deepcopy(base)
        opt_one = torch.optim.AdamW(one.parameters(), lr=1e-2, weight_decay=0.1)
        sched_one = ILSScheduler(one, freeze_rate=0.6, optimizer=opt_one, seed=0, update_scale="none",
                                 optimizer_state=state, distributed=False, warmup_steps=0)
        log_one, losses_one = _train(one, opt_one, sched_one, x, y, steps)
        held = {n: {k: tuple(v["shape"]) for k, v in opt.state[p].items() if k.endswith(Q8)}
                for n, p in model.named_parameters() if p in opt.state}
        out[name] = {"log": log, "log_one": log_one, "weights": _full(model),
                     "weights_one": {n: p.detach().clone() for n, p in one.named_parameters()},
                     "losses": losses, "losses_one": losses_one, "scores": sched.layer_scores(),
                     "scores_one": sched_one.layer_scores(), "chunked": sched.chunked_step is not None,
                     "in_step": bool(sched.chunked_step is not None and sched.chunked_step.pieces_stepped),
                     "between_steps": bool(sched.state_holder is not None and sched.state_holder.between_steps),
                     "held_shapes": held, "host_shapes": {n: {k: tuple(v.shape) for k, v in opt.state[p].items()
                                                              if k.endswith(HOST)}
                                                          for n, p in model.named_parameters() if p in opt.state},
                     "local_shapes": {n: tuple(p.to_local().shape)
                                                           for n, p in model.named_parameters()},
                     "held_nbytes": sched.state_holder.held_nbytes() if sched.state_holder is not None else 0,
                     "held_nbytes_one": (sched_one.state_holder.held_nbytes()
                                         if sched_one.state_holder is not None else 0),
                     "full_moments": {n: sorted(k for k in opt.state[p] if k in ("exp_avg", "exp_avg_sq"))
                                      for n, p in model.named_parameters() if p in opt.state},
                     "blocks_fixed": {n: blocks_fixed(p, 128) for n, p in model.named_parameters()}}
        with torch.no_grad():   # the whole batch's loss after training, both ways (last: FSDP2's root keeps
            out[name]["whole"] = float(((model(x) - y) ** 2).mean())   # its parameters gathered after it)
            out[name]["whole_one"] = float(((one(x) - y) ** 2).mean())
        if name == "q8":
            model.reshard()
            out["portable"] = _portable_resume(model, opt, x[half], y[half])
    out["held_invariance"] = _held_invariance(base, steps)
    return out


def _held_invariance(base, steps):
    """Every moment held 8-bit (the default code) or 4-bit, stepped from the same whole gradients on the shards and
    in one process, cut into pieces of 128 (the shards: every piece at most 100 elements, aligned up) and of 4096:
    per parameter whose shards start at block boundaries and code width ("fc1.weight@4"), whether this rank's
    weights, codes and block maxima are one process's slice of them bit for bit (the draws follow the global index,
    not the cut or the world size)."""
    from slimfit.optim.sharded_params import blocks_fixed, global_start

    out = {}
    for bits in (8, 4):
        shards, opt_s, whole, opt_one, _keep = _held_runs(base, steps, bits)
        for n, p in shards.items():
            if not blocks_fixed(p, 128):
                continue
            local, q, start = p.detach().to_local().reshape(-1), whole[n], global_start(p)
            same = torch.equal(local, q.detach().reshape(-1)[start:start + local.numel()])
            per = 8 // bits
            for key in ("exp_avg", "exp_avg_sq"):
                e, e_one = opt_s.state[p][key + Q8], opt_one.state[q][key + Q8]
                codes_one = e_one["codes"].view(-1)[start // per:-(-(start + local.numel()) // per)]
                same = same and torch.equal(e["codes"].view(-1), codes_one)
                same = same and torch.equal(e["absmax"], e_one["absmax"][start // 128:(start + local.numel()) // 128])
            out[f"{n}@{bits}"] = same
    return out


def _held_runs(base, steps, bits):
    """The sharded and the one-process runs of _held_invariance: (sharded params, its optimizer, whole params, its
    optimizer, what keeps the steps attached)."""
    from torch.distributed.tensor import distribute_tensor

    from slimfit.optim import ChunkedStep, FrozenState

    runs = {}
    for name, model, chunk in (("sharded", _sharded(copy.deepcopy(base)), 100), ("one", copy.deepcopy(base), 4096)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        keep = (ChunkedStep(opt, chunk_numel=chunk),
                FrozenState(opt, "compress", between_steps=True, seed=0, code="dynamic", bits=bits, stochastic=True))
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            for p in model.parameters():
                whole = torch.randn(p.shape, generator=g) * 1e-2
                p.grad = distribute_tensor(whole, p.device_mesh, p.placements) if name == "sharded" else whole
            opt.step()
            opt.zero_grad()
        runs[name] = (dict(model.named_parameters()), opt, keep)
    (shards, opt_s, keep_s), (whole, opt_one, keep_one) = runs["sharded"], runs["one"]
    return shards, opt_s, whole, opt_one, (keep_s, keep_one)


def _portable_resume(model, opt, x, y):
    """The held optimizer's state_dict (the portable format) loaded into a plain torch AdamW over the same
    sharded model, which then steps from it."""
    sd = opt.state_dict()
    moments = [v for st in sd["state"].values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    plain.load_state_dict(sd)
    for p in model.parameters():
        p.requires_grad_(True)
    ((model(x) - y) ** 2).mean().backward()
    plain.step()
    stepped = [v for st in plain.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
    return {"dtensor": all(type(v).__name__ == "DTensor" for v in moments + stepped),
            "count": len(moments), "finite": all(bool(v.to_local().isfinite().all()) for v in stepped),
            "local_match": all(v.to_local().shape == p.to_local().shape for p in model.parameters()
                               for v in (plain.state[p]["exp_avg"],))}


def _measured(model, opt, x, y):
    """slimfit.step_memory on a sharded model: the weights and the optimizer state it counts, against the bytes
    of this rank's pieces (their storages) and of the whole parameters."""
    from slimfit.memory import measure_step

    mem = measure_step(model, (x,), opt, loss_fn=lambda out: ((out - y) ** 2).mean())
    storages = {p.to_local().untyped_storage()._cdata: p.to_local().untyped_storage().nbytes()
                for p in model.parameters()}
    pieces = [v.to_local() if hasattr(v, "to_local") else v for st in opt.state.values() for v in st.values()]
    state = {v.untyped_storage()._cdata: v.untyped_storage().nbytes() for v in pieces}   # the step counts too
    return {"weights": mem.weights, "optimizer_state": mem.optimizer_state, "local": sum(storages.values()),
            "local_state": sum(state.values()), "whole": sum(p.numel() * 4 for p in model.parameters())}
