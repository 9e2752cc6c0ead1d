"""bench/e2e.py (bench.e2e) must keep running: its --quick path on a 2-layer BERT, on the CPU.

Checks that every method builds, trains one step and is reported (CSV, Markdown, PNG), that the
saved-byte and step-peak columns say what the methods are for, and that an older CSV re-renders;
no timing is checked."""
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
    _check_step_peaks(rows)
    md = (tmp_path / "e2e_cpu.md").read_text()
    assert all(m in md for m in METHODS.split(",")) and "step peak MiB" in md
    pytest.importorskip("matplotlib")
    assert (tmp_path / "e2e_cpu.png").stat().st_size > 1000


def _check_step_peaks(rows) -> None:
    """The total step peak (slimfit.step_memory) and its parts, per method."""
    peak = {m: float(r["peak_mib"]) for m, r in rows.items()}
    for r in rows.values():
        parts = [float(r[k]) for k in ("weights_mib", "gradients_mib", "optimizer_mib", "peak_saved_mib",
                                       "transient_mib")]
        assert abs(sum(parts) - float(r["peak_mib"])) < 1e-6 and float(r["static_mib"]) < float(r["peak_mib"])
        assert float(r["peak_saved_mib"]) <= float(r["saved_mib"]) + 0.01
    assert rows["eager"]["weights_mib"] == rows["slimfit-paper"]["weights_mib"]
    # LoRA: no gradient or AdamW moment of the frozen base; 90% frozen: a tenth of them
    assert peak["lora-r8"] < peak["eager"] / 3 and peak["slimfit-paper+lora"] < peak["eager"] / 3
    assert float(rows["lora-r8"]["optimizer_mib"]) < float(rows["eager"]["optimizer_mib"]) / 20
    assert peak["slimfit-paper"] < peak["eager"]


def test_render_only_keeps_an_older_csv_and_its_header(tmp_path):
    """A CSV from before the step-peak columns re-renders: its numbers unchanged, the new columns '-'."""
    csv_text = ("device,model,method,dtype,batch,shape,status,trainable_params,saved_mib,peak_mib,static_mib,step_ms,"
                "throughput,reps,device_name,torch,triton,date\n"
                "cpu,BERT-base,eager,fp32,4,seq 128,ok,109483778,436.6377601623535,,,4463.166319001175,"
                "0.8962247234593694,3,AMD EPYC (2 threads),2.13.0+cpu,3.9.0,2026-11-22 18:35 UTC\n")
    (tmp_path / "e2e_cpu.csv").write_text(csv_text)
    (tmp_path / "e2e_cpu.md").write_text("# End-to-end training step (old machine)\n\nthe old header\n\n### old\n")
    assert e2e.main(["--render-only", "--out-dir", str(tmp_path)]) == 0
    md = (tmp_path / "e2e_cpu.md").read_text()
    assert md.startswith("# End-to-end training step (old machine)\n\nthe old header\n\n### BERT-base")
    assert "| eager | 436.6 | 1.00x | - | - | - | - | 4,463 | 1.00x | 0.90 | 109,483,778 | ok |" in md
    assert "Step peak: not measured in this run" in md


def test_targets_report_met_and_missed():
    row = lambda method, peak, ms: e2e.Row("cuda", "BERT-base", method, "fp32", 128, "seq 128", "ok",  # noqa: E731
                                           peak_mib=peak, step_ms=ms, throughput=128 / (ms / 1e3))
    lines = e2e.targets([row("eager", 40000, 300), row("grad-ckpt", 12000, 420), row("slimfit-paper", 9000, 310)])
    assert lines[0].endswith("-> met")       # 9000 <= 40000 / 4
    assert lines[1].endswith("-> MISSED")    # 310 ms > 300 ms
    assert lines[2].endswith("-> met")       # 420 / 310 = 1.35x the checkpointing throughput
    slow = e2e.targets([row("eager", 40000, 300), row("grad-ckpt", 12000, 350), row("slimfit-paper", 11000, 290)])
    assert slow[0].endswith("-> MISSED") and slow[1].endswith("-> met") and slow[2].endswith("-> MISSED")
