"""bench/meft_memory.py (bench.meft_memory) must keep running: its --quick path (hidden 64, depths 1 and 2) with
saved bytes and the total step peak measured through bench/_measure.py; no timing is checked."""
from __future__ import annotations

import argparse

import pytest

pytest.importorskip("transformers")

from bench import meft_memory  # noqa: E402


def test_quick_run_prints_every_method(capsys):
    meft_memory.main(["--quick"])
    out = capsys.readouterr().out
    assert "depth  2  meft3-nr" in out and "step peak" in out and "meft1: step" in out


def test_rows_and_the_step_peak_table():
    args = argparse.Namespace(depths=[1, 2], batch=2, seq=16, time_depth=1, repeats=1, hidden=64, heads=4, ffn=128,
                              no_peak=False)
    rows, times = meft_memory.run_memory(args)
    by = {(r["depth"], r["method"]): r for r in rows}
    assert by[(2, "meft1")]["saved_bytes"] < by[(2, "meft1-nr")]["saved_bytes"] < by[(2, "plain")]["saved_bytes"]
    # the base is frozen under adapters and MEFT: no gradient, no AdamW moments of its weights
    for method in ("adapters", "meft1", "meft2", "meft3"):
        assert by[(2, method)]["step_peak_bytes"] * 3 < by[(2, "plain")]["step_peak_bytes"]
    md = meft_memory.memory_markdown(args, rows, times)
    assert "## Total step peak, MiB" in md and "| meft3-nr |" in md
