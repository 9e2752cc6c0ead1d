"""bench/seq_sweep.py (bench.seq_sweep) must keep running: its --quick path (llama-tiny, seq 32 and 64, CPU),
through the shared measuring module bench/_measure.py, written and re-rendered; no timing is checked."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bench import seq_sweep  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tests/conftest.py's one_thread) for every test here."""


def test_quick_run_measures_saved_bytes_and_the_step_peak(tmp_path):
    assert seq_sweep.main(["--quick", "--out", str(tmp_path)]) == 0
    cells, _ = seq_sweep.read(str(tmp_path / "seq_sweep_cpu.csv"))
    assert {(c.seq, c.row) for c in cells} == {(s, r) for s in (32, 64) for r in seq_sweep.ROWS}
    by = {(c.seq, c.row): c for c in cells}
    for c in cells:
        p = c.peak
        parts = sum(p[k] for k in ("peak_weights_bytes", "peak_gradients_bytes", "peak_optimizer_bytes",
                                   "peak_saved_bytes", "peak_transient_bytes"))
        assert c.saved > 0 and c.step_s > 0 and parts == p["step_peak_bytes"] > p["step_resident_bytes"]
    for seq in (32, 64):
        plain, frozen, paper = (by[(seq, r)] for r in ("plain-sdpa", "plain-sdpa+frozen", "paper+frozen"))
        assert paper.saved < frozen.saved < plain.saved
        # frozen layers hold no gradient; layers frozen for good hold no AdamW moments either, the
        # scheduler's (paper+frozen) keep theirs
        assert frozen.peak["step_peak_bytes"] < plain.peak["step_peak_bytes"]
        assert paper.peak["step_peak_bytes"] < plain.peak["step_peak_bytes"]
        assert frozen.peak["peak_optimizer_bytes"] < plain.peak["peak_optimizer_bytes"]
        assert paper.peak["peak_optimizer_bytes"] == plain.peak["peak_optimizer_bytes"]
    md = (tmp_path / "seq_sweep_cpu.md").read_text()
    assert "Total step peak MiB" in md and "### Targets (issue 14)" in md
    assert seq_sweep.main(["--render-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "seq_sweep_cpu.md").read_text() == md  # the CSV holds every number the Markdown shows
