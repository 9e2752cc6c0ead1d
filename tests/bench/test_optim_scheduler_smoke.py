"""bench/optim_step_peaks.py and bench/scheduler_overhead.py must keep running (tiny models, CPU): their steps,
step peaks and timings come from bench/_measure.py."""
from __future__ import annotations

import csv

import pytest

pytest.importorskip("transformers")

from bench import optim_step_peaks, scheduler_overhead  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tests/conftest.py's one_thread) for every test here."""


def test_optim_step_peaks_prints_a_row_per_setup(capsys):
    optim_step_peaks.main(["--arch", "bert-tiny", "--seq", "8", "--rows", "1,7"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 3 and rows[1].startswith("| AdamW (CPU default") and rows[2].startswith("| both |")
    assert "9/13 frozen" in rows[1]


def test_scheduler_overhead_times_both_steps(tmp_path):
    out = tmp_path / "overhead.csv"
    scheduler_overhead.main(["--device", "cpu", "--layers", "1", "--hidden", "64", "--seq", "8", "--steps", "2",
                             "--rates", "0.5", "--scores", "relative", "--out", str(out)])
    with open(out, newline="") as fh:
        (row,) = list(csv.DictReader(fh))
    assert row["model"] == "bert-L1-H64" and row["layers"] == "7" and row["n_trained"] == "3"
    assert float(row["train_step_ms"]) > 0 and float(row["sched_step_ms"]) > 0
