"""`slimfit demo`: the same fine-tuning run twice, plain and with slimfit, side by side."""
from __future__ import annotations

import argparse
import sys

from .assets import MissingAsset, load_data, resolve_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="minilm",
                   help="'minilm' (offline all-MiniLM-L6-v2), 'smollm2' (offline SmolLM2-135M-Instruct, a "
                        "decoder answering positive/negative) or a hub id / local path")
    p.add_argument("--data", default="rotten_tomatoes",
                   help="'rotten_tomatoes' (offline) or 'hf:NAME[:CONFIG]', e.g. hf:imdb or hf:glue:sst2 "
                        "(the `datasets` package, network)")
    # Defaults: aggressive() at rate 0.7 keeps full fine-tuning's accuracy on the demo's 120-step protocol at a
    # fraction of its saved bytes, where rate 0.9 costs points (docs/fidelity.md, "The task head", "Freeze rate").
    p.add_argument("--preset", default="aggressive", choices=["exact", "paper", "aggressive"])
    p.add_argument("--rate", type=float, default=0.7,
                   help="freezing rate of the scheduler, in [0, 1); at 0.9 short runs lose accuracy "
                        "(bench/results/accuracy_text_cpu.md)")
    p.add_argument("--frozen-update", default="none", choices=["none", "momentum"],
                   help="what a frozen layer does: 'none' stands still, 'momentum' keeps taking AdamW's step from its "
                        "moments (as SlimFit's published code did) (ILSScheduler frozen_update)")
    p.add_argument("--schedule-head", action="store_true",
                   help="schedule the fresh classifier head like any layer (ILSScheduler always_train=(), SlimFit's "
                        "rule); by default it trains every step")
    p.add_argument("--even-shares", action="store_true",
                   help="every layer trains equally often, the scores ordering it (ILSScheduler "
                        "min_train_share='even'); by default the scores alone pick the trained layers (SlimFit's rule)")
    p.add_argument("--schedule-embeddings", action="store_true",
                   help="schedule the embeddings and norm weights like the weight matrices (ILSScheduler "
                        "scheduled_kinds='all', SlimFit's rule); by default they train every step, which costs no "
                        "activation memory")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--n-train", type=int, default=8000)
    p.add_argument("--n-test", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--no-plain", action="store_true", help="skip the plain PyTorch run")
    p.add_argument("--no-progress", action="store_true")


def _mean(values) -> float:
    return sum(values) / max(len(values), 1)


def _mib(n):
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def _most_saved(result) -> int:
    """The most saved bytes over the run: the scheduler changes the trained layers every step, so its
    final set alone can be a cheap one (plain training saves the same every step)."""
    return result.saved_bytes_max if result.saved_bytes_max is not None else result.saved_bytes


def render(results) -> str:
    rows = [("", [r.name for r in results]),
            ("test accuracy", [f"{100 * r.accuracy:.2f} %" for r in results]),
            ("saved activations / step", [_mib(r.saved_bytes) for r in results]),
            ("  most over the run", [_mib(_most_saved(r)) for r in results]),
            ("whole-step peak", [_mib(r.step_peak_bytes) for r in results]),
            ("peak GPU memory", [_mib(r.peak_bytes) for r in results]),
            ("step time (median)", [f"{r.step_ms:.0f} ms" for r in results]),
            ("layers frozen (mean)", [f"{100 * r.frozen_share:.0f} %" for r in results]),
            ("loss first -> last 10", [f"{_mean(r.losses[:10]):.3f} -> {_mean(r.losses[-10:]):.3f}" for r in results])]
    if len(results) == 2 and results[0].saved_bytes and results[1].saved_bytes:
        ratio = _most_saved(results[0]) / _most_saved(results[1])
        rows.append(("activation memory ratio (most)", ["1.0x", f"{ratio:.1f}x less"]))
    if len(results) == 2 and results[0].step_peak_bytes and results[1].step_peak_bytes:
        ratio = results[0].step_peak_bytes / results[1].step_peak_bytes
        rows.append(("whole-step peak ratio", ["1.0x", f"{ratio:.2f}x less"]))
    width = max(len(k) for k, _ in rows)
    colw = max(len(c) for _, cells in rows for c in cells) + 2
    return "\n".join(f"{k:<{width}}  " + "".join(f"{c:>{colw}}" for c in cells) for k, cells in rows)


# Frozen sets at which the slimfit run's saved bytes are measured (evenly spaced steps, plus the final one).
SAVED_SAMPLES = 10


def _scheduler_options(args) -> dict:
    """ILSScheduler options the flags change (the defaults are left to the scheduler)."""
    options = {}
    if args.frozen_update != "none":
        options["frozen_update"] = args.frozen_update
    if args.even_shares:
        options["min_train_share"] = "even"
    if args.schedule_embeddings:
        options["scheduled_kinds"] = "all"
    return options


def _check_flags(args) -> str | None:
    if not 0 <= args.rate < 1:
        return f"--rate {args.rate}: the freezing rate is a fraction of layers in [0, 1), e.g. 0.9"
    for flag in ("steps", "batch_size", "max_length", "n_train", "n_test"):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1"
    if not args.lr > 0:
        return f"--lr {args.lr}: the learning rate must be positive"
    return None


def run(args) -> int:
    import torch

    from ..training.finetune import count_labels, finetune, quiet_transformers

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    quiet_transformers()
    problem = _check_flags(args)
    if problem:  # before the plain run, which takes minutes
        print(f"slimfit demo: {problem}", file=sys.stderr)
        return 2
    if args.model == "smollm2":  # a decoder: its own task, defaults and run (slimfit/demo/decoder.py)
        from .decoder import run as run_decoder

        return run_decoder(args, device)
    try:
        model_dir = resolve_model(args.model)
        train, test = load_data(args.data, args.seed, args.n_train, args.n_test)
        count_labels(train, test)  # unusable labels stop here, not after the plain run
    except (MissingAsset, ValueError) as exc:
        print(f"slimfit demo: {exc}", file=sys.stderr)
        return 2
    print(f"slimfit demo: {args.model} on {args.data} ({len(train)} train / {len(test)} test), "
          f"{args.steps} steps of batch {args.batch_size}, seq <= {args.max_length}, device {device}, seed {args.seed}")
    common = dict(rate=args.rate, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                  max_length=args.max_length, device=device, progress=not args.no_progress)
    results = []
    if not args.no_plain:
        results.append(finetune(model_dir, train, test, preset=None, **common))
        print(f"  done: {results[-1].name}: accuracy {100 * results[-1].accuracy:.2f} %", flush=True)
    results.append(finetune(model_dir, train, test, preset=args.preset,
                            always_train=() if args.schedule_head else None,
                            scheduler_options=_scheduler_options(args), saved_samples=SAVED_SAMPLES, **common))
    print(f"  done: {results[-1].name}: accuracy {100 * results[-1].accuracy:.2f} %", flush=True)
    print()
    print(render(results))
    if args.rate > 0:
        share = 1 - args.rate
        print(f"\nAt rate {args.rate} each scheduled layer trains in {'' if args.even_shares else 'on average '}about "
              f"{share:.0%} of the steps ({share * args.steps:.0f} of {args.steps} here)"
              + ("" if args.schedule_embeddings else "; the embedding tables train every step")
              + ("" if args.schedule_head else "; the classifier head trains every step")
              + ("" if args.frozen_update == "none" else "; frozen layers keep moving by their AdamW moments")
              + " (bench/results/accuracy_text_cpu.md in the source tree).")
    return 0
