"""bench/accuracy.py must keep running: its --quick path (a few steps on tiny splits of the
offline Rotten Tomatoes set, pretrained MiniLM-L6). A check of the pipeline, not of accuracy."""
from __future__ import annotations

import csv

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from slimfit.demo.assets import MissingAsset, minilm_dir  # noqa: E402

from ._load import load_bench  # noqa: E402


def _assets_present() -> bool:
    try:
        minilm_dir()
        return True
    except MissingAsset:
        return False


pytestmark = pytest.mark.skipif(not _assets_present(), reason="offline assets not installed (bash scripts/setup.sh test)")


@pytest.fixture(scope="module")
def accuracy():
    return load_bench("accuracy")


def test_quick_run_appends_rows_and_renders_table(accuracy, tmp_path):
    methods = ["full", "paper@0.9", "lora", "meft1"]
    assert accuracy.main(["--quick", "--no-progress", "--methods", ",".join(methods), "--out-dir", str(tmp_path)]) == 0
    with open(tmp_path / "accuracy_text_cpu.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["method"] for r in rows] == methods
    assert all(0.0 <= float(r["accuracy"]) <= 1.0 and float(r["saved_mib"]) > 0 for r in rows)
    by = {r["method"]: r for r in rows}
    assert float(by["paper@0.9"]["saved_mib"]) < float(by["full"]["saved_mib"]) / 3
    assert int(by["lora"]["trainable_params"]) < int(by["full"]["trainable_params"]) / 20
    md = (tmp_path / "accuracy_text_cpu.md").read_text()
    assert all(f"| {m} |" in md for m in methods)

    # a second run with the same settings finds every (method, seed) done and trains nothing
    assert accuracy.main(["--quick", "--no-progress", "--methods", ",".join(methods), "--out-dir", str(tmp_path)]) == 0
    with open(tmp_path / "accuracy_text_cpu.csv", newline="") as fh:
        assert len(list(csv.DictReader(fh))) == len(methods)


def test_unknown_method_fails_before_training(accuracy, tmp_path):
    with pytest.raises(SystemExit, match="unknown method"):
        accuracy.main(["--quick", "--methods", "full,nonsense", "--out-dir", str(tmp_path)])
