"""bench/attention_memory.py (bench.attention_memory) must keep running: its --quick path (seq 128) and one short
length measured through bench/_measure.py (saved bytes, attention share, total step peak); no timing is checked."""
from __future__ import annotations

import argparse

import pytest

pytest.importorskip("transformers")

from bench import _timing, attention_memory  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tests/conftest.py's one_thread) for every test here."""


def test_quick_run_prints_the_table(capsys):
    attention_memory.main(["--quick", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "step peak MiB" in out and all(m in out for m in attention_memory.METHODS)


def test_rows_have_saved_bytes_shares_and_step_peaks():
    args = argparse.Namespace(batch=1, repeats=1, no_peak=False)
    rows = {r["method"]: r for r in attention_memory.bench_seq(64, args, _timing.Settings.quick())}
    assert list(rows) == list(attention_memory.METHODS)
    base, auto = rows[attention_memory.BASELINE], rows["paper(), auto"]
    assert base["ratio_vs_frozen_plain"] == 1.0 and auto["ratio_vs_frozen_plain"] > 2
    assert auto["attention_bytes"] < base["attention_bytes"]
    for r in rows.values():
        assert r["step_peak_bytes"] > r["step_resident_bytes"] > 0 and r["step_ms"] > 0
    plain = rows["plain sdpa, all trainable"]
    assert base["step_peak_bytes"] < plain["step_peak_bytes"] and auto["step_peak_bytes"] < plain["step_peak_bytes"]
    # the slimfit row's frozen set stands for the scheduler's: AdamW keeps every layer's state, as plain's
    assert auto["peak_optimizer_bytes"] == plain["peak_optimizer_bytes"] > base["peak_optimizer_bytes"]
