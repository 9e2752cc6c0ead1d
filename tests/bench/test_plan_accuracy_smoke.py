"""bench/plan_accuracy.py (bench.plan_accuracy) must keep running: its --quick path on tiny models."""
from __future__ import annotations

import csv

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from bench import plan_accuracy  # noqa: E402


def test_quick_run_writes_rows_within_the_target(tmp_path, capsys):
    assert plan_accuracy.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    with open(tmp_path / "plan_accuracy_cpu.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(plan_accuracy.QUICK)
    assert all(r["status"] == "ok" and abs(float(r["error_pct"])) <= plan_accuracy.TARGET_PCT for r in rows)
    md = (tmp_path / "plan_accuracy_cpu.md").read_text()
    assert "p90" in md and "bert-tiny" in md
    # resumable: a second run skips what the CSV holds
    assert plan_accuracy.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    assert "skip (in the CSV)" in capsys.readouterr().out


def test_quick_without_out_dir_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(plan_accuracy._results, "RESULTS_DIR", str(tmp_path))
    assert plan_accuracy.main(["--quick", "--only", "llama"]) == 0
    assert list(tmp_path.iterdir()) == []


def test_percentiles():
    assert plan_accuracy.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert plan_accuracy.percentile([0.0, 10.0], 90) == 9.0
