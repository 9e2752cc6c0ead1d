"""Total step peak of BERT-base (batch 2, seq 32) under the ILS scheduler, with slimfit.optim's tools on or off.

    python -m bench.optim_step_peaks [--arch bert-base] [--batch 2] [--seq 32] [--rate 0.7]

The measurement behind docs/optim.md's table, small enough for
a 2-core CPU (about a minute per row). Each row builds the model afresh (seed 0), trains one step with every
layer trainable so that every layer has real AdamW state (as after the scheduler's first round robin), then
builds ILSScheduler(freeze_rate=rate) with the optimizer attached, trains one more step, and measures the
third's total peak through bench/_measure.py (slimfit.step_memory: forward, backward, optimizer step,
zero_grad, then the scheduler's step, which compresses and restores the layers whose state changes), with
the optimizer's state as those steps left it.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/optim_step_peaks.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse

import torch

from bench import _measure
from slimfit.optim import step_in_backward
from slimfit.scheduler import ILSScheduler

ROWS = {  # name: (optimizer keywords, frozen state mode or None, step in backward)
    "AdamW (CPU default: for-loop)": ({}, None, False),
    "AdamW foreach (the CUDA default)": ({"foreach": True}, None, False),
    "AdamW fused": ({"fused": True}, None, False),
    "+ frozen state compressed": ({}, "compress", False),
    "+ frozen state offloaded (CPU: same memory)": ({}, "offload", False),
    "+ step in backward": ({}, None, True),
    "both": ({}, "compress", True),
    "both, foreach": ({"foreach": True}, "compress", True),
    "both, fused": ({"fused": True}, "compress", True),
}
MIB = 2**20


def measure_row(arch: str, batch: int, seq: int, rate: float, kwargs: dict, mode, in_backward: bool):
    """One row: (StepMemory, frozen layers, scheduled layers)."""
    arch, model = _measure.build(arch, seed=0)
    kwargs = {"lr": 1e-5, **kwargs}
    opt = (step_in_backward(model, torch.optim.AdamW, **kwargs) if in_backward
           else torch.optim.AdamW(model.parameters(), **kwargs))
    # prime=False: the state measured is what the two trained steps left (some of it compressed), not made up
    setup = _measure.Setup(model, _measure.inputs(model, arch, batch, seq), optimizer=opt, prime=False)
    setup.step()                                    # every layer trains once: real state everywhere
    sched = ILSScheduler(model, freeze_rate=rate, optimizer=opt, frozen_state=mode, warmup_steps=0)
    setup.after_step = sched.step
    setup.step()
    run = _measure.measure(setup, _measure.What(saved=False)).peak
    return run, sched.num_frozen, sched.num_layers


def _row(name: str, run) -> str:
    cells = [run.total, run.weights, run.gradients, run.optimizer_state, run.saved, run.transient]
    return f"| {name} | " + " | ".join(f"{c / MIB:,.0f}" for c in cells) + f" | {run.peak_phase} |"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="bert-base")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--rate", type=float, default=0.7)
    ap.add_argument("--rows", default="", help="comma-separated row numbers (1-based); all by default")
    args = ap.parse_args(argv)
    names = list(ROWS)
    if args.rows:
        names = [names[int(i) - 1] for i in args.rows.split(",")]
    print("| setup | total peak (MiB) | weights | gradients | optimizer state | saved | transient | peak in |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        kwargs, mode, in_backward = ROWS[name]
        run, frozen, layers = measure_row(args.arch, args.batch, args.seq, args.rate, kwargs, mode, in_backward)
        print(_row(name, run), f"<!-- {frozen}/{layers} frozen; phases {run.phase_peaks} -->", flush=True)


if __name__ == "__main__":
    main()
