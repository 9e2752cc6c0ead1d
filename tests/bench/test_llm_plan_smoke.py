"""bench/llm_plan.py (bench.llm_plan) must keep running: its --quick path on a tiny decoder."""
from __future__ import annotations

import csv

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from bench import llm_plan  # noqa: E402


def test_quick_run_writes_every_row_with_its_header(tmp_path):
    assert llm_plan.main(["--quick", "--device", "cpu", "--out-dir", str(tmp_path)]) == 0
    with open(tmp_path / "llm_plan.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    cpu_rows = [label for label, fields in llm_plan.ROWS.items() if fields.get("optimizer") not in llm_plan.CUDA_ONLY]
    assert [r["row"] for r in rows] == cpu_rows   # bitsandbytes' fused recipe is planned for a GPU only
    assert len(cpu_rows) == len(llm_plan.ROWS) - 1
    assert all(float(r["peak_gib"]) >= 0 and r["peak_phase"] for r in rows)
    md = (tmp_path / "llm_plan.md").read_text()
    assert "bench/llm_plan.py --quick" in md and "commit" in md and "torch" in md and "llama-tiny" in md


def test_quick_without_out_dir_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(llm_plan._results, "RESULTS_DIR", str(tmp_path))
    assert llm_plan.main(["--quick", "--device", "cpu"]) == 0
    assert list(tmp_path.iterdir()) == []
