"""bench/patch_memory.py (bench.patch_memory) must keep running: its --quick path on the 2-layer Llama-tiny,
measured through bench/_measure.py (saved bytes, total step peak, step time); no timing is checked."""
from __future__ import annotations

import csv

import pytest

pytest.importorskip("transformers")

from bench import patch_memory  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tests/conftest.py's one_thread) for every test here."""


def test_quick_run_reports_saved_bytes_and_step_peaks(tmp_path):
    assert patch_memory.main(["--quick", "--models", "llama-tiny", "--out-dir", str(tmp_path)]) == 0
    with open(tmp_path / "patch_memory_cpu.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    main = {r["method"]: r for r in rows if r["frozen_seed"] in ("", "0")}
    assert list(main) == list(patch_memory.METHODS)
    assert [r["frozen_seed"] for r in rows if r["method"] == "paper+frozen"] == ["0", "1"]
    saved = {m: int(r["saved_bytes"]) for m, r in main.items()}
    peak = {m: int(r["step_peak_bytes"]) for m, r in main.items()}
    assert saved["paper+frozen"] * 4 < saved["plain"] and peak["paper+frozen"] < peak["plain+frozen"] < peak["plain"]
    for r in main.values():
        parts = sum(int(r[k]) for k in ("peak_weights_bytes", "peak_gradients_bytes", "peak_optimizer_bytes",
                                        "peak_saved_bytes", "peak_transient_bytes"))
        assert parts == int(r["step_peak_bytes"]) > int(r["step_resident_bytes"]) and float(r["step_ms"]) > 0
    md = (tmp_path / "patch_memory_cpu.md").read_text()
    assert "step peak MiB" in md and "where the paper() bytes are" in md
