#!/usr/bin/env python
"""Where one training step of a frontier row spends its time: PyTorch's profiler over a few steps, the ops and
kernels that take the most device (or CPU) time, printed and written as a text table.

    python -m bench.profile_step --case smollm2-2048 --method slimfit-paper --dtype bf16 --device cuda
    python -m bench.profile_step --case bert-16 --method sdpa,slimfit-paper --quick      # CPU, 2 layers

The rows are bench/frontier.py's (same model, batch, optimizer and scheduler); compare methods measured in
one run. Output: bench/results/profile_<case>_<dtype>_<device>.txt unless --out says otherwise.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/profile_step.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import dataclasses
import os
import sys

import torch

from bench import _results, frontier
from slimfit import architectures as archs


def profile(case: str, method: str, args) -> str:
    """The profiler's table for `method` on `case`: warm-up steps, then args.steps profiled steps."""
    arch_name, batch, seq = frontier.CASES[case]
    arch = archs.resolve(arch_name)
    if args.quick:
        arch = dataclasses.replace(arch, config={**arch.config, "num_hidden_layers": 2})
        batch, seq = 2, 32
    cuda = args.device.startswith("cuda")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with frontier.method_setup(arch, frontier.METHODS[method], batch, seq, args.device, args.dtype) as setup:
        for _ in range(args.warmup):
            setup.step()
        if cuda:
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.steps):
                setup.step()
            if cuda:
                torch.cuda.synchronize()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=60)
    return f"## {case}, {method}, {args.dtype}, {args.steps} steps profiled\n\n{table}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", default="smollm2-2048", choices=sorted(frontier.CASES))
    p.add_argument("--method", default="sdpa,slimfit-paper", help="comma-separated frontier methods")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--quick", action="store_true", help="2-layer model, batch 2, seq 32")
    p.add_argument("--out", default=None, help="the text file (default bench/results/profile_...)")
    args = p.parse_args(argv)
    versions = _results.versions()
    header = (f"# Profile of one step: {args.case}, {args.dtype}, {_results.device_name(args.device)}\n\n"
              f"torch {versions['torch']}, commit {_results.commit_label()}, {_results.now()}\n\n")
    text = header + "".join(profile(args.case, m, args) for m in args.method.split(","))
    print(text)
    if not args.quick:
        out = args.out or os.path.join(_results.RESULTS_DIR, f"profile_{args.case}_{args.dtype}_"
                                                             f"{_results.device_tag(args.device)}.txt")
        with open(out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
