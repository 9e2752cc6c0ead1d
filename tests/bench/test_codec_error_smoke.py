"""bench/codec_error.py must keep running: its --quick path (a random bert-tiny, 5 AdamW steps) measures every
code (and the moments each code held through the run) and writes the table where it is told to."""
from __future__ import annotations

import csv

import pytest

pytest.importorskip("transformers")

from bench import codec_error  # noqa: E402


def test_quick_run_measures_every_code(tmp_path, capsys):
    assert codec_error.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    with open(tmp_path / "codec_error_cpu.csv", newline="") as fh:
        rows = {r["code"]: r for r in csv.DictReader(fh)}
    assert set(rows) == set(codec_error.CODES)
    assert all(r["v -> 0"] == "0" for r in rows.values())            # no code makes a nonzero v zero
    for rounding in ("stochastic", "nearest"):
        dyn = rows[f"dynamic 8-bit ({rounding})"]
        assert float(dyn["u(v̂) err"]) < 0.05 and 0.7 < float(dyn["u(v̂)/u min"]) <= float(dyn["u(v̂)/u max"]) < 1.5
        assert float(rows[f"dynamic 4-bit ({rounding})"]["x fp32"]) > 7.4 and float(dyn["x fp32"]) > 3.8
        assert float(dyn["held err"]) < 0.1 and 0.9 < float(dyn["held |u|"]) < 1.1   # held through the 5 steps
    assert {name for name, r in rows.items() if r["held err"] != "-"} == set(codec_error.HELD)
    assert "dynamic 4-bit (stochastic)" in capsys.readouterr().out
