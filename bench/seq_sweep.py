#!/usr/bin/env python
"""Saved-for-backward bytes and step time against the strongest default, across sequence lengths (issue 14).

    python -m bench.seq_sweep                  # BERT-base, llama-small, SmolLM2-135M at seq 128..4096, batch 1, CPU;
                                               # writes bench/results/seq_sweep_cpu.{csv,md}
    python -m bench.seq_sweep --quick          # llama-tiny at seq 32 and 64: a smoke check (writes only with --out)
    python -m bench.seq_sweep --models llama-small --seqs 256 1024 2048 --max-gib 8
    python -m bench.seq_sweep --render-only    # rebuild the Markdown from bench/results/seq_sweep_cpu.csv

Models (`slimfit memory`'s architectures, random weights: the bytes saved do not depend on the values):
  bert-base     BertForSequenceClassification, BERT-base sizes; its position table is extended to the longest
                sequence asked (random weights: only the sizes matter)
  llama-small   the issue's Llama: hidden 256, 4 layers, 8 heads, 2 KV heads, intermediate 512, vocab 8000
  smollm2-135m  SmolLM2-135M's sizes: 30 layers, hidden 576, GQA 9/3, vocab 49152, tied embeddings

Rows (one model object, patched and unpatched in turn, same batch, same seed):
  plain-eager        plain PyTorch, eager attention, every parameter trainable
  plain-sdpa         plain PyTorch, sdpa attention (the transformers default), every parameter trainable
  plain-sdpa+frozen  plain sdpa with the frozen set of ILSScheduler(model, freeze_rate=0.9, seed=0) at its first step
  paper+frozen       slimfit.patch(model, SlimFitConfig.paper()) + the same frozen set (sdpa model)
  aggressive+frozen  slimfit.patch(model, SlimFitConfig.aggressive()) + the same frozen set

Measured per row by bench/_measure.py: the saved bytes (`slimfit.memory.measure`: saved-tensor hooks, parameters
not counted) of one forward + backward; the total peak of one whole training step (slimfit.step_memory: forward,
backward, AdamW step with lr 0 over the trainable parameters, zero_grad; AdamW's state made beforehand) with its
parts at the peak; the step time of that same step without tracking, --repeats runs (default 1). Rows are compared
on the CPU time of the process (time.process_time: all threads, not inflated by other processes on a shared
machine); wall time is in the CSV. Runs before the step peak was measured timed forward + backward only (their
Markdown header says so). Ratios are against the STRONGER plain baseline (the smaller of plain-eager and
plain-sdpa, all trainable) and against plain sdpa with the same frozen set. A row whose saved bytes, extrapolated
from the shorter lengths, would pass --max-gib, or whose step would take longer than --max-step-s, is skipped
and said so. `--render-only` rebuilds the Markdown from the CSV, keeping the Markdown's header.

The issue's targets are printed, met or not:
  T1  every length, every model: slimfit (paper and aggressive) keeps no more than plain sdpa, same frozen set
  T2  SmolLM2-135M, seq 2048: >= 4x less than plain sdpa all trainable, >= 2x less than plain sdpa same frozen
      set, step time within 1.2x of plain sdpa same frozen set
  T3  BERT-base, seq 128: >= 8x less than plain eager and >= 6x less than plain sdpa (all trainable)
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/seq_sweep.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import dataclasses
import math
import os
import sys

import torch

from bench import _measure, _results, _timing

ROWS = ("plain-eager", "plain-sdpa", "plain-sdpa+frozen", "paper+frozen", "aggressive+frozen")
SLIM_ROWS = ("paper+frozen", "aggressive+frozen")
DEFAULT_MODELS = ("bert-base", "llama-small", "smollm2-135m")
DEFAULT_SEQS = (128, 512, 1024, 2048, 4096)
FREEZE_RATE = 0.9


@dataclasses.dataclass
class Cell:
    model: str
    seq: int
    row: str
    saved: int | None = None
    step_s: float | None = None    # CPU time of the process per step (what the rows are compared on)
    wall_s: float | None = None    # wall-clock time per step (inflated by other processes on a shared machine)
    note: str = ""
    peak: dict = dataclasses.field(default_factory=dict)  # _measure.peak_columns: the step peak and its parts


def _predict(history: list[tuple[int, float]], seq: int, quadratic: bool) -> float | None:
    """Extrapolate a value measured at shorter lengths to `seq` (growth exponent of the last two points)."""
    if not history:
        return None
    if len(history) == 1:
        exponent = 2.0 if quadratic else 1.5
    else:
        (s1, v1), (s2, v2) = history[-2], history[-1]
        exponent = math.log(max(v2, 1e-9) / max(v1, 1e-9)) / math.log(s2 / s1)
    s_last, v_last = history[-1]
    return v_last * (seq / s_last) ** max(exponent, 1.0)


def case(model, inputs, row: str, frozen) -> _measure.Case:
    """The row as a bench/_measure.py case: attention, preset and frozen set of `row` on the one model."""
    preset = row.split("+")[0] if row in SLIM_ROWS else None
    attn = "eager" if row == "plain-eager" else "sdpa"
    return _measure.Case(row, lambda: _measure.configured(model, inputs, config=preset, attn=attn,
                                                          frozen=frozen if row.endswith("+frozen") else ()))


def _skip_note(cell: Cell, bytes_hist, time_hist, args) -> str:
    est_bytes = _predict(bytes_hist[cell.row], cell.seq, quadratic=cell.row == "plain-eager")
    est_time = _predict(time_hist[cell.row], cell.seq, quadratic=True)
    if est_bytes is not None and est_bytes > args.max_gib * 2**30:
        return f"skipped: ~{est_bytes / 2**30:.1f} GiB expected (> --max-gib {args.max_gib})"
    if est_time is not None and est_time > args.max_step_s:
        return f"skipped: ~{est_time:.0f} s per step expected (> --max-step-s {args.max_step_s})"
    return ""


def _what(args) -> _measure.What:
    reps = max(1, args.repeats)
    return _measure.What(peak=not args.no_peak, time=_timing.Settings(
        cpu_warmup=0 if not args.no_peak else 1, cpu_min_reps=reps, cpu_max_reps=reps, cpu_min_time_s=0.0,
        cpu_slow_min_reps=reps, cpu_clock="process"))


def sweep_model(name: str, seqs, args, cells: list[Cell]) -> None:
    arch, model = _measure.build(name, seq_len=max(seqs))
    frozen, candidates = _measure.frozen_set(model, FREEZE_RATE, seed=0)
    print(f"\n{name}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; "
          f"frozen {len(frozen)} of {len(candidates)} candidate layers", flush=True)
    bytes_hist = {row: [] for row in ROWS}
    time_hist = {row: [] for row in ROWS}
    for seq in seqs:
        inputs = _measure.inputs(model, arch, 1, seq)
        for row in ROWS:
            cell = Cell(name, seq, row)
            cells.append(cell)
            cell.note = _skip_note(cell, bytes_hist, time_hist, args)
            if not cell.note:
                ((_, result),) = _measure.run([case(model, inputs, row, frozen)], _what(args))
                cell.saved, cell.peak = result.saved.total, _measure.peak_columns(result)
                # kept as the CSV keeps them (4 decimals), so a table rendered now equals one rendered from the CSV
                cell.step_s = round(result.timing.process_ms / 1e3, 4)
                cell.wall_s = round(result.timing.wall_ms / 1e3, 4)
                bytes_hist[row].append((seq, cell.saved))
                time_hist[row].append((seq, cell.wall_s))
            print(f"  seq {seq:5d}  {row:<18} {_shown(cell)}", flush=True)
    del model


def _shown(cell: Cell) -> str:
    if cell.saved is None:
        return cell.note
    peak = cell.peak.get("step_peak_bytes")
    return (f"{cell.saved / 2**20:10.1f} MiB saved  {'-' if peak in (None, '') else f'{peak / 2**20:10.1f}'} MiB "
            f"step peak  {cell.step_s:8.2f} s CPU {cell.wall_s:8.2f} s wall")


# ------------------------------------------------------------------ ratios, targets, files
def _get(cells, model, seq, row) -> Cell | None:
    return next((c for c in cells if (c.model, c.seq, c.row) == (model, seq, row)), None)


def stronger(cells, model, seq) -> tuple[str, int] | None:
    """(row, bytes) of the smaller all-trainable plain baseline."""
    found = [(c.row, c.saved) for r in ("plain-eager", "plain-sdpa")
             if (c := _get(cells, model, seq, r)) is not None and c.saved is not None]
    return min(found, key=lambda x: x[1]) if found else None


def _ratio(base: int | None, run: int | None) -> float | None:
    return None if not base or not run else base / run


def targets(cells) -> list[tuple[str, bool | None, str]]:
    """(target, met (None: not measured), figures)."""
    out = []
    worst = None
    for c in cells:
        if c.row in SLIM_ROWS and c.saved is not None:
            ref = _get(cells, c.model, c.seq, "plain-sdpa+frozen")
            if ref is not None and ref.saved is not None:
                r = ref.saved / c.saved
                if worst is None or r < worst[0]:
                    worst = (r, c)
    if worst is None:
        out.append(("T1 slimfit <= plain sdpa same frozen set, every length", None, "not measured"))
    else:
        r, c = worst
        out.append(("T1 slimfit <= plain sdpa same frozen set, every length", r >= 1.0,
                    f"worst: {c.model} seq {c.seq} {c.row} {r:.2f}x"))
    for row in SLIM_ROWS:
        c = _get(cells, "smollm2-135m", 2048, row)
        full = _get(cells, "smollm2-135m", 2048, "plain-sdpa")
        fro = _get(cells, "smollm2-135m", 2048, "plain-sdpa+frozen")
        if c is None or c.saved is None or full is None or full.saved is None or fro is None or fro.saved is None:
            out.append((f"T2 SmolLM2 seq 2048 {row}", None, "not measured"))
            continue
        r_full, r_fro, t = full.saved / c.saved, fro.saved / c.saved, c.step_s / fro.step_s
        out.append((f"T2 SmolLM2 seq 2048 {row}: >= 4x vs plain sdpa all trainable", r_full >= 4, f"{r_full:.2f}x"))
        out.append((f"T2 SmolLM2 seq 2048 {row}: >= 2x vs plain sdpa same frozen set", r_fro >= 2, f"{r_fro:.2f}x"))
        out.append((f"T2 SmolLM2 seq 2048 {row}: step time <= 1.2x plain sdpa same frozen set", t <= 1.2,
                    f"CPU {c.step_s:.1f} s vs {fro.step_s:.1f} s = {t:.2f}x "
                    f"(wall {c.wall_s:.1f} vs {fro.wall_s:.1f} s)"))
    for row in SLIM_ROWS:
        c = _get(cells, "bert-base", 128, row)
        eager, sdpa = _get(cells, "bert-base", 128, "plain-eager"), _get(cells, "bert-base", 128, "plain-sdpa")
        if c is None or c.saved is None or eager is None or sdpa is None or None in (eager.saved, sdpa.saved):
            out.append((f"T3 BERT-base seq 128 {row}", None, "not measured"))
            continue
        r_e, r_s = eager.saved / c.saved, sdpa.saved / c.saved
        out.append((f"T3 BERT-base seq 128 {row}: >= 8x vs plain eager", r_e >= 8, f"{r_e:.2f}x"))
        out.append((f"T3 BERT-base seq 128 {row}: >= 6x vs plain sdpa", r_s >= 6, f"{r_s:.2f}x"))
    return out


def _mib(c: Cell | None) -> str:
    if c is None:
        return "-"
    return f"{c.saved / 2**20:,.1f}" if c.saved is not None else "skipped"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _peak_mib(c: Cell | None) -> str:
    if c is None or c.saved is None:
        return "-" if c is None else "skipped"
    value = c.peak.get("step_peak_bytes")
    return "-" if value in (None, "") else f"{value / 2**20:,.1f}"


def _peak_parts(c: Cell | None) -> str:
    keys = ("peak_weights_bytes", "peak_gradients_bytes", "peak_optimizer_bytes", "peak_saved_bytes",
            "peak_transient_bytes")
    if c is None or any(c.peak.get(k) in (None, "") for k in keys):
        return "-"
    return " + ".join(f"{c.peak[k] / 2**20:,.1f}" for k in keys)


def peak_table(cells, model: str) -> list[str]:
    """Total step peak per row and length, the ratios of paper(), and paper()'s parts at its peak."""
    if all(c.peak.get("step_peak_bytes") in (None, "") for c in cells if c.model == model):
        return ["", "Total step peak: not measured in this run (the column is newer than it)."]
    lines = ["", "Total step peak MiB (forward, backward, AdamW step, zero_grad; AdamW state resident):", "",
             "| seq | " + " | ".join(f"{r}" for r in ROWS) + " | paper vs stronger | paper vs same frozen "
             "| paper+frozen at its peak: weights + grads + AdamW + saved + transient |",
             "|---:|" + "---:|" * len(ROWS) + "---:|---:|---|"]

    def peak(c):
        return None if c is None or c.peak.get("step_peak_bytes") in (None, "") else c.peak["step_peak_bytes"]

    for seq in sorted({c.seq for c in cells if c.model == model}):
        row_cells = {r: _get(cells, model, seq, r) for r in ROWS}
        plains = [p for p in (peak(row_cells["plain-eager"]), peak(row_cells["plain-sdpa"])) if p is not None]
        paper = peak(row_cells["paper+frozen"])
        lines.append(f"| {seq} | " + " | ".join(_peak_mib(row_cells[r]) for r in ROWS)
                     + f" | {_x(_ratio(min(plains) if plains else None, paper))}"
                     + f" | {_x(_ratio(peak(row_cells['plain-sdpa+frozen']), paper))}"
                     + f" | {_peak_parts(row_cells['paper+frozen'])} |")
    return lines


def render_md(cells, header: list[str]) -> str:
    lines = list(header)
    for model in dict.fromkeys(c.model for c in cells):
        seqs = sorted({c.seq for c in cells if c.model == model})
        lines += ["", f"### {model}", "",
                  "| seq | " + " | ".join(f"{r} MiB" for r in ROWS)
                  + " | stronger baseline | paper vs stronger | paper vs same frozen | aggressive vs stronger "
                    "| aggressive vs same frozen | step CPU s: sdpa+frozen / paper / aggressive |",
                  "|---:|" + "---:|" * len(ROWS) + "---|---:|---:|---:|---:|---|"]
        for seq in seqs:
            lines.append(_saved_line(cells, model, seq))
        notes = sorted({c.note for c in cells if c.model == model and c.note})
        for note in notes:
            rows = ", ".join(f"{c.row} @ {c.seq}" for c in cells if c.model == model and c.note == note)
            lines.append(f"\n{rows}: {note}")
        lines += peak_table(cells, model)
    lines += ["", "### Targets (issue 14)", "", "| target | met | figures |", "|---|---|---|"]
    for name, met, figures in targets(cells):
        lines.append(f"| {name} | {'n/a' if met is None else ('yes' if met else 'NO')} | {figures} |")
    return "\n".join(lines) + "\n"


def _saved_line(cells, model: str, seq: int) -> str:
    row_cells = [_get(cells, model, seq, r) for r in ROWS]
    base = stronger(cells, model, seq)
    fro = _get(cells, model, seq, "plain-sdpa+frozen")
    ratios = []
    for r in SLIM_ROWS:
        c = _get(cells, model, seq, r)
        ratios += [_x(_ratio(base[1] if base else None, c.saved if c else None)),
                   _x(_ratio(fro.saved if fro else None, c.saved if c else None))]
    times = " / ".join("-" if c is None or c.step_s is None else f"{c.step_s:.2f}"
                       for c in (fro, _get(cells, model, seq, "paper+frozen"),
                                 _get(cells, model, seq, "aggressive+frozen")))
    return (f"| {seq} | " + " | ".join(_mib(c) for c in row_cells)
            + f" | {base[0] if base else '-'} | " + " | ".join(ratios) + f" | {times} |")


CSV_FIELDS = ["commit", "model", "seq", "batch", "row", "saved_bytes", "step_cpu_s", "step_wall_s", "note",
              *_measure.PEAK_COLUMNS]


def write(cells, header, out_dir: str | None, commit: str) -> str:
    csv_path = _results.results_path("seq_sweep", "csv", "cpu", out_dir)
    _results.write_rows(csv_path, [[commit, c.model, c.seq, 1, c.row, c.saved if c.saved is not None else "",
                                    f"{c.step_s:.4f}" if c.step_s is not None else "",
                                    f"{c.wall_s:.4f}" if c.wall_s is not None else "", c.note,
                                    *(c.peak.get(k, "") for k in _measure.PEAK_COLUMNS)] for c in cells],
                        CSV_FIELDS)
    _results.write_text(_results.results_path("seq_sweep", "md", "cpu", out_dir), render_md(cells, header))
    return csv_path


def read(path: str) -> tuple[list[Cell], str]:
    """(cells, commit) of a results CSV; columns newer than the file read as not measured."""
    def num(d: dict, key: str, kind=float):
        return kind(d[key]) if d.get(key) not in (None, "") else None

    cells, commit = [], ""
    for d in _results.read_rows(path):
        commit = d["commit"]
        peak = {k: num(d, k, int) for k in _measure.PEAK_COLUMNS if num(d, k, int) is not None}
        cells.append(Cell(d["model"], int(d["seq"]), d["row"], num(d, "saved_bytes", int), num(d, "step_cpu_s"),
                          num(d, "step_wall_s"), d["note"], peak))
    return cells, commit


def render_only(out_dir: str | None) -> int:
    """Rebuild the Markdown from the CSV: every number as the CSV has it, the Markdown's header kept."""
    cells, commit = read(_results.results_path("seq_sweep", "csv", "cpu", out_dir))
    md_path = _results.results_path("seq_sweep", "md", "cpu", out_dir)
    old = open(md_path).read() if os.path.exists(md_path) else ""
    header = old[:old.index("\n### ")].rstrip("\n").split("\n") if "\n### " in old else []
    _results.write_text(md_path, render_md(cells, header))
    print(f"rewrote {md_path}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS),
                   help="architecture names, each optionally with its own lengths: smollm2-135m:512,2048")
    p.add_argument("--seqs", nargs="+", type=int, default=list(DEFAULT_SEQS))
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (1 makes CPU time a clean measure of work on a busy machine)")
    p.add_argument("--max-gib", type=float, default=6.0, help="skip rows expected to save more (default 6 GiB)")
    p.add_argument("--max-step-s", type=float, default=240.0, help="skip rows expected to take longer per step")
    p.add_argument("--repeats", type=int, default=1, help="timed steps per row after the measured ones (default 1)")
    p.add_argument("--no-peak", action="store_true", help="saved bytes and step time only, no step peak")
    p.add_argument("--quick", action="store_true", help="llama-tiny at seq 32 and 64; writes nothing unless --out")
    p.add_argument("--render-only", action="store_true", help="only rebuild the Markdown from the CSV")
    p.add_argument("--out", default=None, help="output folder (default bench/results)")
    return p


def _header(argv, commit: str) -> list[str]:
    import transformers

    return ["# Saved-for-backward bytes, total step peak and step time vs sequence length (bench/seq_sweep.py)", "",
            f"Command: `{_results.command('seq_sweep', argv)}`", "",
            f"Commit: {commit}; {_results.now()}; {_results.cpu_model()}, {torch.get_num_threads()} threads; "
            f"torch {torch.__version__}, transformers {transformers.__version__}.",
            f"Batch 1, fp32, train mode, CPU. Frozen set: ILSScheduler(freeze_rate={FREEZE_RATE}, seed=0) at its "
            "first step. MiB = bytes autograd saves for backward in one step (slimfit.memory). 'stronger baseline' "
            "= the smaller of plain eager and plain sdpa, all trainable. Step peak: the total peak of one training "
            "step (forward, backward, AdamW step with lr 0, zero_grad; AdamW state made beforehand; "
            "slimfit.step_memory, tensor storages sampled after every op). Step times: that step (AdamW included), "
            f"CPU seconds of the process ({torch.get_num_threads()} thread(s)) on a shared machine; wall times in "
            "the CSV. Compare rows of one run, not runs."]


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.render_only:
        return render_only(args.out)
    if args.quick:
        args.models, args.seqs = ["llama-tiny"], [32, 64]
    if args.threads:
        torch.set_num_threads(args.threads)
    commit = _results.commit_label()
    header = _header(argv, commit)
    cells: list[Cell] = []
    print("\n".join(header), flush=True)
    for spec in args.models:
        name, _, own = spec.partition(":")
        seqs = [int(x) for x in own.split(",")] if own else args.seqs
        sweep_model(name, sorted(seqs), args, cells)
    print()
    print(render_md(cells, []))
    if not args.quick or args.out is not None:
        print(f"wrote {write(cells, header, args.out, commit)} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
