"""How often the scheduler trains each layer: the share of steps each candidate layer of MiniLM-L6 trained
in, fine-tuning on Rotten Tomatoes (the accuracy benchmark's text task), per scheduler option.

    python -m bench.train_shares                                   # paper@0.7, +abs, +even; 200 steps, seed 1
    python -m bench.train_shares --specs paper@0.9 --steps 100 --seed 0
    python -m bench.train_shares --quick                           # pipeline check: 3 steps, writes nothing

Specs are bench/accuracy.py's scheduled methods with their options (`python -m bench.accuracy --help`).
Why it exists: under AdamW every weight moves by about lr x |m / sqrt(v)| per step, so SlimFit's relative
score (mean |ΔW / W|) ranks layers by the size of their weights; this table shows which layers that leaves
frozen (docs/fidelity.md, "Which layers are scheduled").
Results: bench/results/train_shares_cpu.{csv,md}, one CSV row per (spec, seed, steps, layer); a spec already
there with the same settings is skipped.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/train_shares.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import statistics

import torch

from bench import _results
from bench import accuracy as acc

FIELDS = ["spec", "seed", "steps", "layer", "group", "trained_steps", "score", "accuracy", "date"]
DEFAULT_SPECS = "paper@0.7,paper@0.7+abs,paper@0.7+even"
# BERT-family parameter names -> the group a table row summarises (first match wins)
GROUPS = (("LayerNorm", "LayerNorm weights"), ("embeddings", "embeddings"), ("self.query", "Q, K"),
          ("self.key", "Q, K"), ("self.value", "V"), ("attention.output.dense", "attention output"),
          ("intermediate.dense", "FFN in"), ("output.dense", "FFN out"), ("pooler", "pooler"),
          ("classifier", "task head"))


def group_of(name: str) -> str:
    return next((group for key, group in GROUPS if key in name), "other")


def run_spec(spec: str, args) -> tuple[float, list[tuple[str, int, float]]]:
    """Test accuracy and (layer, steps trained, last score) of one fine-tuning run."""
    prepare, _ = acc.method_prepare(spec, args.steps)
    kept = {}

    def keep_scheduler(model, seed):
        from slimfit.scheduler.candidates import find_candidates

        prepared = prepare(model, seed)
        kept["scheduler"] = prepared.scheduler
        # Before the first forward nothing is frozen yet: every candidate still requires grad.
        kept["candidates"] = [name for name, _ in find_candidates(model)]
        return prepared

    result = acc.TextTask(args).run(args.seed, keep_scheduler, args.lr, "cpu", not args.no_progress)
    sched = kept["scheduler"]
    if sched is None:
        raise SystemExit(f"{spec!r} has no scheduler: give a scheduled method (paper@R, exact@R, ...)")
    counts, scores = sched.train_counts(), sched.layer_scores()
    # Candidates the scheduler leaves out (scheduled_kinds, always_train) train every step.
    return result.accuracy, [(name, counts.get(name, args.steps), scores.get(name, float("nan")))
                             for name in kept["candidates"]]


def render(rows: list[dict], header: str) -> str:
    lines = [header, ""]
    keys = sorted({(r["steps"], r["seed"]) for r in rows})
    for steps, seed in keys:
        part = [r for r in rows if r["steps"] == steps and r["seed"] == seed]
        specs = list(dict.fromkeys(r["spec"] for r in part))
        groups = list(dict.fromkeys(r["group"] for r in part))
        accuracy = {r["spec"]: 100 * float(r["accuracy"]) for r in part}
        lines += [f"## {steps} steps, seed {seed}", "",
                  "Share of the steps each layer trained in: min / median / max over the layers of a group "
                  "(n layers). Test accuracy: " + ", ".join(f"{s} {accuracy[s]:.2f}%" for s in specs) + ".", ""]
        body = []
        for group in groups:
            cells = [group, str(sum(1 for r in part if r["group"] == group and r["spec"] == specs[0]))]
            for spec in specs:
                shares = [int(r["trained_steps"]) / int(steps) for r in part
                          if r["group"] == group and r["spec"] == spec]
                cells.append(f"{min(shares):.0%} / {statistics.median(shares):.0%} / {max(shares):.0%}")
            body.append(cells)
        lines += _results.md_table(["layers", "n", *specs], body, right=set(range(1, len(specs) + 2)))
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--specs", default=DEFAULT_SPECS)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out-dir", default=None, help="default bench/results (nothing is written with --quick)")
    p.add_argument("--quick", action="store_true", help="pipeline check: 3 steps of 8 on 64/32 examples")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.lr, args.batch_size, args.max_length, args.n_train, args.n_test = 1e-4, 32, 48, 8000, 2000
    if args.quick:
        args.steps, args.batch_size, args.n_train, args.n_test, args.max_length = 3, 8, 64, 32, 32
    if args.threads:
        torch.set_num_threads(args.threads)
    acc.quiet_transformers()
    write = args.out_dir is not None or not args.quick
    csv_path = _results.results_path("train_shares", "csv", "cpu", args.out_dir) if write else None
    done = _results.read_rows(csv_path) if csv_path else []
    for spec in [s.strip() for s in args.specs.split(",") if s.strip()]:
        if any(_results.matches(r, spec=spec, seed=args.seed, steps=args.steps) for r in done):
            print(f"skip {spec}: already in {csv_path}")
            continue
        accuracy, layers = run_spec(spec, args)
        rows = [{"spec": spec, "seed": args.seed, "steps": args.steps, "layer": name, "group": group_of(name),
                 "trained_steps": count, "score": f"{score:.4g}", "accuracy": f"{accuracy:.4f}",
                 "date": _results.now()} for name, count, score in layers]
        print(f"{spec}: accuracy {100 * accuracy:.2f}%; trained steps per layer min {min(c for _, c, _ in layers)}, "
              f"max {max(c for _, c, _ in layers)} of {args.steps}", flush=True)
        if csv_path:
            for row in rows:
                _results.append_row(csv_path, row, FIELDS)
            done = _results.read_rows(csv_path)
    if csv_path and done:
        versions = _results.versions()
        header = (f"# Which layers the scheduler trains (MiniLM-L6, Rotten Tomatoes)\n\n"
                  f"{_results.device_name('cpu')}, torch {versions['torch']}; `{_results.command('train_shares')}` "
                  f"(rows: bench/results/train_shares_cpu.csv; batch 32, seq <= 48, AdamW lr 1e-4, as "
                  f"bench/accuracy.py's text task). Method names: `python -m bench.accuracy --help`.")
        _results.write_text(_results.results_path("train_shares", "md", "cpu", args.out_dir), render(done, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
