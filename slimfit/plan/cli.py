"""`slimfit plan <model>`: the predicted peak of one whole training step, before the run.

    slimfit plan bert-base --batch 8 --seq 256 --preset paper --rate 0.7
    slimfit plan smollm2-135m --batch 4 --seq 1024 --dtype bf16 --lora 16 --checkpointing
    slimfit plan ./config.json --batch 2 --seq 2048 --fit 24GiB      # the fastest configuration that fits

<model>: an architecture name (`slimfit memory --help` lists them), a config.json or a folder holding one, or a
hub id whose config is already in the local cache (nothing is downloaded). The step is predicted on fake
tensors (slimfit/plan/predict.py): no memory is allocated, a few seconds for a 100M-parameter model.
"""
from __future__ import annotations

import argparse
import re
import sys

from .. import architectures as archs

__all__ = ["add_arguments", "run", "main", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """'24GiB' / '24G' (binary), '24GB' (decimal), '500MiB', '1e9' -> bytes; ValueError otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 24GiB, 500MiB, 16GB)")
    return int(float(match.group(1)) * _UNITS[unit])


def _size(n: float) -> str:
    """Bytes as text in KiB, MiB or GiB (the unit that keeps the number readable)."""
    for unit, scale in (("KiB", 2**10), ("MiB", 2**20)):
        if n < 1024 * scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n / 2**30:,.2f} GiB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `slimfit plan` (slimfit/cli.py adds them to its subcommand)."""
    parser.description = ("Predict the total peak memory of one training step (forward, backward, optimizer "
                          "step) before the run, without allocating it; --fit finds the fastest configuration "
                          "under a budget.")
    parser.add_argument("model", help=f"an architecture ({', '.join(archs.known_names())}), a config.json or its "
                        "folder, or a hub id whose config is in the local cache")
    parser.add_argument("--batch", type=int, required=True, help="batch size")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (text models)")
    parser.add_argument("--image-size", type=int, default=None, help="image side in pixels (vision models; "
                        "default: the config's)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="fp32, or bf16 autocast")
    parser.add_argument("--preset", choices=["none", "exact", "paper", "aggressive"], default="none",
                        help="slimfit preset (default none: plain PyTorch)")
    parser.add_argument("--rate", type=float, default=0.0, help="ILSScheduler freeze rate in [0, 1) (default 0)")
    parser.add_argument("--lora", type=int, default=None, metavar="R", help="LoRA rank (peft); the base is frozen")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing of every layer")
    parser.add_argument("--optimizer", choices=["adamw", "adamw8bit"], default="adamw",
                        help="adamw (torch) or adamw8bit (torchao, when installed)")
    parser.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa", help="attention (default sdpa)")
    parser.add_argument("--task", choices=[archs.TEXT_CLS, archs.CAUSAL_LM, archs.IMAGE_CLS], default=None,
                        help="override the task the config implies")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="the step's device: cpu (exact), or cuda (an estimate: docs/plan.md)")
    parser.add_argument("--frozen-state", choices=["auto", "none", "compress", "offload", "compress_all"],
                        default="auto",
                        help="with --rate: every layer's AdamW state held 8-bit (compress_all; auto, the "
                             "scheduler's default, is compress_all where the optimizer's step can hold it, else "
                             "compress), the frozen layers' only (compress), in host memory (offload; saves only on "
                             "a GPU), or in full (none)")
    parser.add_argument("--fit", default=None, metavar="BUDGET",
                        help="search presets, rates, frozen-state options, LoRA and checkpointing at this batch "
                             "for the fastest configuration whose step peak fits BUDGET (e.g. 24GiB), print its code")


def _spec(args, **changes):
    """The StepSpec the arguments describe, with `changes` applied."""
    from .spec import StepSpec

    values = dict(batch=args.batch, seq=args.seq, image_size=args.image_size, dtype=args.dtype,
                  optimizer=args.optimizer, preset=args.preset, rate=args.rate, lora=args.lora,
                  checkpointing=args.checkpointing, attn=args.attn, device=args.device, task=args.task,
                  frozen_state=None if args.frozen_state == "none" else args.frozen_state)
    values.update(changes)
    return StepSpec(args.model, **values)


def _header(p) -> list[str]:
    """The lines that say what was predicted: model, shape, configuration, the scheduler's frozen set."""
    spec = p.spec
    lines = [f"slimfit plan: {p.model_name} ({p.params / 1e6:.1f}M parameters, {spec.device}); {spec.shape()}, "
             f"{spec.label()}"]
    if spec.rate:
        lines.append(f"  ILSScheduler: {p.frozen_layers} of {p.layers} layers frozen in this step "
                     f"(its first frozen set, seed {spec.seed}); AdamW state for every parameter")
    lines.append(f"  trainable now: {p.trained / 1e6:.2f}M parameters; optimizer state for {p.optimized / 1e6:.2f}M")
    return lines


def report(p) -> str:
    """The prediction as text: the peak, its parts, where it is, the estimated step time."""
    m = p.memory
    rows = [("predicted step peak", m.total), ("  weights", m.weights), ("  gradients", m.gradients),
            ("  optimizer state", m.optimizer_state), ("  saved activations", m.saved), ("  transient", m.transient),
            ("resident at entry", m.resident)]
    width = max(len(label) for label, _ in rows)
    lines = _header(p) + [""] + [f"{label:<{width}}  {_size(v):>12}" for label, v in rows]
    lines.append(f"{'peak in':<{width}}  {m.peak_phase:>12}")
    where = "one thread's CPU time here" if p.spec.device == "cpu" else "an H100-class GPU"
    lines.append(f"estimated step time: {p.step_time():.3g} s ({where}; slimfit/plan/cost.py: for ranking "
                 "configurations, not a benchmark)")
    note = "exact for the CPU step" if p.spec.device == "cpu" else (
        "an estimate for CUDA: the CPU step with CUDA's foreach AdamW; add the CUDA context and allocator slack")
    lines.append(f"(predicted in {p.seconds:.1f} s on fake tensors, nothing allocated; {note}; docs/plan.md)")
    if p.checks_answered:
        lines.append(f"({p.checks_answered} data-dependent check(s) in the step answered as in a healthy step: "
                     "values finite)")
    return "\n".join(lines)


def _fit(args) -> int:
    """--fit: search (search.py), print the candidates tried, the fastest that fits and its code; 1 if none."""
    from .code import render
    from .search import fit

    budget = parse_bytes(args.fit)
    base = _spec(args)
    print(f"slimfit plan --fit {_size(budget)}: {base.model_name}, {base.shape()}, {base.dtype}, {base.optimizer}; "
          "searching presets x rates x checkpointing, and LoRA", flush=True)
    result = fit(base, budget, lora_rank=args.lora,
                 on_candidate=lambda c: print(f"  predicted {c.spec.label():40s} {_size(c.total):>12}  {c.status}",
                                              flush=True))
    print()
    print(_table(result))
    if result.best is None:
        print(f"\nnothing fits {_size(budget)} at batch {base.batch}: lower the batch or the sequence length")
        return 1
    best = result.best.prediction
    print(f"\nfastest that fits: {best.spec.label()}: {_size(best.total)} predicted "
          f"({100.0 * best.total / budget:.0f}% of the budget)\n")
    print(render(best, budget_bytes=_scheduler_budget(best, budget)))
    return 0


def _scheduler_budget(p, budget: int) -> int | None:
    """The budget for the scheduler's budget mode when it can keep it (its base and cheapest layer fit), so
    that the frozen sets of later steps stay within it; None otherwise (or without a scheduler)."""
    if not p.spec.rate:
        return None
    from .budget import scheduler_budget

    b = scheduler_budget(p.spec, budget)
    return budget if b["base_bytes"] + min(b["activation_bytes"].values(), default=0) <= budget else None


def _table(result) -> str:
    """The candidates, fastest (estimated) first, with their estimated time relative to the fastest."""
    fastest = min(c.est_seconds for c in result.candidates)
    head = f"  {'configuration':40s} {'est. time':>9}  {'resident':>10}  {'step peak':>10}  status"
    lines = ["candidates, fastest first (est. time relative to the fastest; resident: weights + optimizer state):",
             head]
    for c in result.candidates:
        peak = _size(c.total) if c.total is not None else "-"
        lines.append(f"  {c.spec.label():40s} {c.est_seconds / fastest:>8.2f}x  {_size(c.resident):>10}  "
                     f"{peak:>10}  {c.status}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the command for parsed arguments; 2 (and the reason on stderr) for arguments that cannot be planned."""
    from .predict import predict

    try:
        if args.fit is not None:
            return _fit(args)
        spec = _spec(args)
        print(report(predict(spec)))
        if spec.rate and spec.budget_bytes is None:
            from .budget import rate_bound

            print(f"any later step at rate {spec.rate:g} (another trained set): at most {_size(rate_bound(spec))} "
                  "(the all-frozen peak plus the largest layers' bytes as many as train; docs/plan.md). To hold "
                  "a budget at every step: --fit, or ILSScheduler(budget_bytes=...)")
    except (ValueError, TypeError) as exc:
        print(f"slimfit plan: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m slimfit.plan.cli`: the command on its own."""
    parser = argparse.ArgumentParser(prog="slimfit plan")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
