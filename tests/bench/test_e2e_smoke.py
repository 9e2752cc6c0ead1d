"""bench/e2e.py (bench.e2e) must keep running: its --quick path on a 2-layer BERT, on the CPU.

Checks that every method builds, trains one step and is reported (CSV, Markdown, PNG), and that
the saved-byte column says what the methods are for; no timing is checked."""
from __future__ import annotations

import csv

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from bench import e2e  # noqa: E402

METHODS = "eager,sdpa,grad-ckpt,lora-r8,slimfit-exact,slimfit-paper,slimfit-paper+lora,slimfit-wta_crs"


def test_quick_run_reports_every_method(tmp_path):
    rc = e2e.main(["--quick", "--models", "bert", "--dtypes", "fp32", "--methods", METHODS,
                   "--out-dir", str(tmp_path)])
    assert rc == 0
    with open(tmp_path / "e2e_cpu.csv", newline="") as fh:
        rows = {r["method"]: r for r in csv.DictReader(fh)}
    assert list(rows) == METHODS.split(",")
    assert all(r["status"] == "ok" and float(r["step_ms"]) > 0 for r in rows.values())
    saved = {m: float(r["saved_mib"]) for m, r in rows.items()}
    # checkpointing keeps only layer inputs; slimfit paper() + 90% frozen keeps far less than eager
    assert saved["grad-ckpt"] < saved["sdpa"] / 3
    assert saved["slimfit-paper"] < saved["eager"] / 4
    assert saved["slimfit-paper+lora"] < saved["lora-r8"] / 2
    assert saved["slimfit-wta_crs"] <= saved["slimfit-paper"]  # same frozen set; trainable targets keep k rows
    trainable = {m: int(r["trainable_params"]) for m, r in rows.items()}
    assert trainable["lora-r8"] < trainable["eager"] / 20
    md = (tmp_path / "e2e_cpu.md").read_text()
    assert all(m in md for m in METHODS.split(","))
    pytest.importorskip("matplotlib")
    assert (tmp_path / "e2e_cpu.png").stat().st_size > 1000


def test_targets_report_met_and_missed():
    row = lambda method, peak, ms: e2e.Row("cuda", "BERT-base", method, "fp32", 128, "seq 128", "ok",  # noqa: E731
                                           peak_mib=peak, step_ms=ms, throughput=128 / (ms / 1e3))
    lines = e2e.targets([row("eager", 40000, 300), row("grad-ckpt", 12000, 420), row("slimfit-paper", 9000, 310)])
    assert lines[0].endswith("-> met")       # 9000 <= 40000 / 4
    assert lines[1].endswith("-> MISSED")    # 310 ms > 300 ms
    assert lines[2].endswith("-> met")       # 420 / 310 = 1.35x the checkpointing throughput
    slow = e2e.targets([row("eager", 40000, 300), row("grad-ckpt", 12000, 350), row("slimfit-paper", 11000, 290)])
    assert slow[0].endswith("-> MISSED") and slow[1].endswith("-> met") and slow[2].endswith("-> MISSED")
