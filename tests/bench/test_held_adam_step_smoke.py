"""bench/held_adam_step.py (bench.held_adam_step) must keep running: its --quick path writes every row, the held
rows hold less optimizer state than torch's, and the fused held step dispatches a handful of ops."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bench import _results, held_adam_step  # noqa: E402


def test_quick_run_writes_every_row(tmp_path):
    assert held_adam_step.main(["--quick", "--out", str(tmp_path)]) == 0
    rows = _results.read_rows(str(tmp_path / "held_adam_step_cpu.csv"))
    got = {(r["model"], r["dtype"], r["row"]): r for r in rows}
    assert len(got) == len(held_adam_step.QUICK_MODELS) * len(held_adam_step.DTYPES) * len(held_adam_step.ROWS)
    for model in held_adam_step.QUICK_MODELS:
        for dtype in held_adam_step.DTYPES:
            torch_state = float(got[(model, dtype, "torch foreach")]["state_mib"])
            assert float(got[(model, dtype, "held fused")]["state_mib"]) < torch_state
            assert int(got[(model, dtype, "held fused")]["ops"]) <= 5
            assert int(got[(model, dtype, "held unfused")]["ops"]) > 100
    assert "vs torch foreach" in (tmp_path / "held_adam_step_cpu.md").read_text()
