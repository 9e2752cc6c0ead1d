"""The many-class text task (Debian's fortune files): labels by file size, clean texts, clear errors."""
import pytest

from slimfit.demo import assets


def _write(folder, name, texts):
    (folder / name).write_text("\n%\n".join(texts) + "\n%\n")
    (folder / f"{name}.dat").write_bytes(b"\0" * 8)      # index files are skipped


def test_topics_by_size_and_split(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "FORTUNES_DIR", str(tmp_path))
    _write(tmp_path, "small", [f"s {i}" for i in range(3)])
    _write(tmp_path, "big", [f"b {i}\n  wrapped" for i in range(6)] + ["x" * 1001])   # too long: dropped
    _write(tmp_path, "mid", [f"m {i}" for i in range(4)])
    train, test = assets.fortunes(seed=0, n_train=8, n_test=2, classes=2)
    rows = train + test
    assert len(train) == 8 and len(test) == 2
    assert {y for _, y in rows} == {0, 1}                       # big = 0, mid = 1, small left out
    assert all(t.startswith("b ") for t, y in rows if y == 0)
    assert all("\n" not in t and "  " not in t for t, _ in rows)
    assert assets.fortunes(seed=0, n_train=8, n_test=2, classes=2) == (train, test)   # seeded


def test_missing_or_too_few(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "FORTUNES_DIR", str(tmp_path / "none"))
    with pytest.raises(assets.MissingAsset, match="apt-get install fortunes"):
        assets.fortunes()
    monkeypatch.setattr(assets, "FORTUNES_DIR", str(tmp_path))
    _write(tmp_path, "only", ["a", "b"])
    with pytest.raises(assets.MissingAsset, match="fewer than 16"):
        assets.fortunes()
    with pytest.raises(ValueError, match="asked for"):
        assets.fortunes(n_train=5, n_test=5, classes=1)
