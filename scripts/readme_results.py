#!/usr/bin/env python
"""The README's numbers, generated from bench/results (never copied by hand).

    python scripts/readme_results.py           # rewrite README.md's generated blocks
    python scripts/readme_results.py --check   # exit 1 when README.md differs from what the results say

Blocks: between `<!-- generated:headline -->` / `<!-- generated:table -->` / `<!-- generated:gpu -->` and
`<!-- end -->`. Sources: bench/results/frontier_cpu.csv (the total step peak of one whole training step, per
model and method, on the CPU); on a GPU bench/results/frontier_gpu.csv, its fp32 run: step peak and step
time.
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
FRONTIER = os.path.join(ROOT, "bench", "results", "frontier_cpu.csv")
FRONTIER_GPU = os.path.join(ROOT, "bench", "results", "frontier_gpu.csv")
GPU_COLUMNS = {("bert-16", "fp32"): "BERT-base, batch 16, seq 128", ("bert-64", "fp32"): "BERT-base, batch 64, seq 128",
               ("smollm2-2048", "fp32"): "SmolLM2-135M shape, batch 1, seq 2048"}
CASES = {"bert-16": "BERT-base, batch 16, seq 128", "smollm2-2048": "SmolLM2-135M shape, batch 1, seq 2048"}
METHODS = {"sdpa": "PyTorch, full fine-tuning (SDPA)", "grad-ckpt": "gradient checkpointing",
           "adamw8bit-bnb": "8-bit AdamW (bitsandbytes)", "badam": "BAdam (one block at a time)",
           "lora-r8": "LoRA r=8", "lora-r8+ckpt": "LoRA r=8 + checkpointing",
           "slimfit-paper+q8all": "**slimfit `paper()`**, full fine-tuning (defaults: every AdamW state 8-bit)",
           "slimfit-aggressive+q8all": "slimfit `aggressive()`, every AdamW state 8-bit",
           "slimfit-paper+q8": "slimfit `paper()`, frozen layers' AdamW state 8-bit (`frozen_state=\"compress\"`)",
           "slimfit-paper": "slimfit `paper()`, AdamW state in full (`frozen_state=None`)",
           "slimfit-paper+offload":
               "slimfit `paper()`, frozen layers' AdamW state in host memory (`frozen_state=\"offload\"`)",
           "slimfit-paper+lora": "slimfit `paper()` + LoRA r=8",
           "slimfit-paper+lora+ckpt": "slimfit `paper()` + LoRA r=8 + checkpointing"}


def _rows() -> dict:
    """{(case, method): step peak MiB} of the measured rows (the last measurement of each)."""
    out = {}
    with open(FRONTIER, newline="") as fh:
        for row in csv.DictReader(fh):
            if row.get("step_peak_mib"):
                out[(row["case"], row["method"])] = float(row["step_peak_mib"])
    return out


def headline(rows: dict) -> str:
    parts = []
    for case, label in CASES.items():
        plain, mine = rows.get((case, "sdpa")), rows.get((case, "slimfit-paper+q8all"))   # the defaults
        if plain and mine:
            parts.append(f"{label}: {mine:,.0f} MiB instead of {plain:,.0f} MiB ({plain / mine:.2f}x less)")
    return ("Total peak memory of one whole training step (weights, gradients, AdamW state, activations, "
            "temporaries), full fine-tuning with `paper()` and the scheduler's defaults against plain PyTorch: "
            + "; ".join(parts) + ".")


def _methods_table(title: str, columns: dict, rows: dict, cell, skip_empty: bool = False,
                   left_out: tuple = ()) -> str:
    """One row per METHODS entry (but `left_out`), one column per `columns` key that has an sdpa row;
    `cell(got, plain)` the text of a measured cell ("-" when not measured); `skip_empty`: rows measured
    nowhere left out."""
    shown = [c for c in columns if (c, "sdpa") in rows]
    lines = [f"| {title} | " + " | ".join(columns[c] for c in shown) + " |", "|---|" + "---:|" * len(shown)]
    for method, label in METHODS.items():
        if method in left_out:
            continue
        cells = ["-" if (c, method) not in rows else cell(rows[(c, method)], rows[(c, "sdpa")]) for c in shown]
        if not skip_empty or any(text != "-" for text in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(rows: dict) -> str:
    # offload on a CPU: the "host" is the same memory, so it saves nothing there (the GPU table shows it)
    return _methods_table("step peak, MiB (CPU, fp32)", CASES, rows,
                          lambda peak, plain: f"{peak:,.0f} ({plain / peak:.2f}x)", skip_empty=True,
                          left_out=("slimfit-paper+offload",))


def _gpu_rows() -> dict:
    """{(column, method): (step peak MiB, step ms)} of the GPU frontier (one run per dtype)."""
    out = {}
    with open(FRONTIER_GPU, newline="") as fh:
        for row in csv.DictReader(fh):
            key = (row["case"], row["dtype"])
            if key in GPU_COLUMNS and row.get("step_peak_mib") and row.get("step_s"):
                out[(key, row["method"])] = (float(row["step_peak_mib"]), 1e3 * float(row["step_s"]))
    return out


def gpu_table(rows: dict) -> str:
    return _methods_table("step peak MiB, step ms (NVIDIA H200)", GPU_COLUMNS, rows,
                          lambda got, plain: f"{got[0]:,.0f} ({plain[0] / got[0]:.2f}x), {got[1]:,.0f} ms "
                                             f"({got[1] / plain[1]:.2f}x)", skip_empty=True)


def render(text: str) -> str:
    rows = _rows()
    blocks = (("headline", headline(rows)), ("table", table(rows)), ("gpu", gpu_table(_gpu_rows())))
    for name, body in blocks:
        # the block's text up to its own end marker (lazy: never past it into the next block)
        pattern = re.compile(rf"(<!-- generated:{name} -->\n).*?(<!-- end -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"README.md has no <!-- generated:{name} --> block")
        text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
    return text


def main(argv=None) -> int:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--check", action="store_true")
    check = args.parse_args(argv).check
    current = open(README).read()
    wanted = render(current)
    if check:
        if wanted != current:
            print("README.md's numbers differ from bench/results: run python scripts/readme_results.py")
            return 1
        return 0
    with open(README, "w") as fh:
        fh.write(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
