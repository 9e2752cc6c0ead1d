"""bench/llm_measure.py (bench.llm_measure) must keep running: its --quick path on a tiny decoder, predicted and
measured (the plan is exact on the CPU there)."""
from __future__ import annotations

import csv

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from bench import llm_measure  # noqa: E402


def test_quick_run_predicts_and_measures_every_row(tmp_path):
    assert llm_measure.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    with open(tmp_path / "llm_measure_cpu.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["row"] for r in rows] == list(llm_measure.ROWS)
    assert all(float(r["measured_mib"]) > 0 and abs(float(r["error_pct"])) < 1.0 for r in rows)
    md = (tmp_path / "llm_measure_cpu.md").read_text()
    assert "bench/llm_measure.py --quick" in md and "llama-tiny" in md and "Largest |error|" in md
    # resumable: a second run finds every row done and measures nothing again
    assert llm_measure.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    with open(tmp_path / "llm_measure_cpu.csv", newline="") as fh:
        assert len(list(csv.DictReader(fh))) == len(rows)


def test_quick_without_out_dir_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(llm_measure._results, "RESULTS_DIR", str(tmp_path))
    assert llm_measure.main(["--quick"]) == 0
    assert list(tmp_path.iterdir()) == []
