"""bench/train_shares.py must keep running: its --quick path writes one row per candidate layer and a table."""
from __future__ import annotations

import csv

import pytest

pytest.importorskip("transformers")

from _bench_assets import minilm_present  # noqa: E402

from bench import train_shares  # noqa: E402


@pytest.mark.skipif(not minilm_present(), reason="offline assets not installed (bash scripts/setup.sh test)")
def test_quick_run_counts_every_layer(tmp_path):
    assert train_shares.main(["--quick", "--no-progress", "--specs", "paper@0.7+even", "--out-dir", str(tmp_path)]) == 0
    with open(tmp_path / "train_shares_cpu.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 54                                     # MiniLM-L6's candidate layers
    # The 3 embedding tables and 13 LayerNorms train every step; of the 38 weight matrices 38 - round(0.7 x 38) = 11.
    assert sum(int(r["trained_steps"]) for r in rows) == 3 * (16 + 11)
    assert "| LayerNorm weights | 13 |" in (tmp_path / "train_shares_cpu.md").read_text()


def test_groups_of_bert_names():
    assert train_shares.group_of("bert.encoder.layer.0.attention.output.LayerNorm.weight") == "LayerNorm weights"
    assert train_shares.group_of("bert.encoder.layer.0.attention.output.dense.weight") == "attention output"
    assert train_shares.group_of("bert.encoder.layer.0.output.dense.weight") == "FFN out"
    assert train_shares.group_of("classifier.weight") == "task head"
