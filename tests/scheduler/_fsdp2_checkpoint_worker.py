"""Body of the FSDP2 distributed-checkpoint test (imported by spawned processes): the defaults' held moments
and the scheduler's state saved with torch.distributed.checkpoint at one world size, loaded at another."""
import os

import torch
import torch.distributed as dist
from _models import MLP, regression_data
from _two_ranks import free_port, init_worker


def run(rank, world, port, outdir, phase):
    init_worker(rank, world, port)
    try:
        if phase == "save":
            result = _save(rank, world, outdir)
        elif phase == "relay":   # loaded from ckpt, saved again to ckpt_relay at this world size
            result = _load(world, outdir, True, relay=True)
        else:
            result = _load(world, outdir, phase != "bare", source="ckpt_relay" if phase == "last" else "ckpt")
        torch.save(result, os.path.join(outdir, f"{phase}{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _setup():
    from _fsdp2_optim_worker import _sharded

    from slimfit.scheduler import ILSScheduler

    torch.manual_seed(0)
    model = _sharded(MLP())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, ILSScheduler(model, freeze_rate=0.6, optimizer=opt, seed=0, warmup_steps=0)


def _moments(model, opt) -> dict:
    """Every parameter's moments as the whole tensors (decoded where held), and whether they are held."""
    from slimfit.optim.codec import decode
    from slimfit.optim.sharded_params import like_param

    out = {}
    for name, p in model.named_parameters():
        st = opt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            held = key + "@slimfit_q8" in st
            value = like_param(decode(st[key + "@slimfit_q8"]), p) if held else st[key]
            out[(name, key)] = (value.full_tensor(), held)
    return out


def _save(rank, world, outdir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, sched = _setup()
    x, y = regression_data(n=64, seed=0)
    n = 64 // world
    for _ in range(3):
        ((model(x[rank * n:(rank + 1) * n]) - y[rank * n:(rank + 1) * n]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    with sched.every_layer_trainable():
        model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(outdir, "ckpt"))
    return {"moments": _moments(model, opt), "scheduler": sched.state_dict(), "frozen": sched.frozen_names()}


def _load(world, outdir, trainable, source="ckpt", relay=False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    saved = torch.load(os.path.join(outdir, "save0.pt"), weights_only=False)
    model, opt, sched = _setup()
    sched.load_state_dict(saved["scheduler"])   # the saved frozen set in force while loading
    frozen = sched.frozen_names()
    context = sched.every_layer_trainable() if trainable else _nothing()
    with context:
        model_sd, optim_sd = get_state_dict(model, opt)
        sd = {"model": model_sd, "optim": optim_sd}
        dcp.load(sd, checkpoint_id=os.path.join(outdir, source))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        if relay:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(outdir, "ckpt_relay"))
    loaded = _moments_or_none(model, opt)
    if not trainable:   # (a frozen layer left without any state: nothing to hold again)
        return {"loaded": loaded, "frozen": frozen}
    sched.load_state_dict(saved["scheduler"])   # the frozen-set hook holds the scheduled layers' moments again,
    sched.state_holder.freeze(list(model.parameters()))   # the others' the next step would hold: held now
    return {"loaded": loaded, "held_again": _moments(model, opt), "frozen": frozen}


def _moments_or_none(model, opt):
    out = {}
    for name, p in model.named_parameters():
        st = opt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            out[(name, key)] = st[key].full_tensor() if key in st else None   # None: no state loaded
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def spawn(world, outdir, phase, timeout_s=240):
    import torch.multiprocessing as mp

    ctx = mp.start_processes(run, args=(world, free_port(), outdir, phase), nprocs=world, join=False,
                             start_method="spawn")
    import time

    deadline = time.time() + timeout_s
    while not ctx.join(timeout=5):
        if time.time() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{phase} at world size {world} did not finish")
    return [torch.load(os.path.join(outdir, f"{phase}{r}.pt"), weights_only=False) for r in range(world)]
