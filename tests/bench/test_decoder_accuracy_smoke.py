"""bench/decoder_accuracy.py: the quick run (a tiny random Llama, 3 steps) trains every method and the table
compares each with full fine-tuning over the same seeds; the fortunes task on fortune files of its own."""
import sys

import pytest
import torch

from bench import accuracy, decoder_accuracy
from slimfit.demo import assets


@pytest.fixture
def fortune_dir(tmp_path, monkeypatch):
    """16 topic files named as FORTUNE_TOPICS, the first the largest (30 fortunes down to 15), and a small one."""
    for i, (topic, _) in enumerate(decoder_accuracy.FORTUNE_TOPICS):
        (tmp_path / topic).write_text("\n%\n".join(f"{topic} saying {k}\n  wrapped" for k in range(30 - i)) + "\n%\n")
    (tmp_path / "tiny").write_text("a\n%\nb\n%\n")
    monkeypatch.setattr(assets, "FORTUNES_DIR", str(tmp_path))
    return tmp_path


def test_quick_run_prints_the_comparison(capsys):
    assert decoder_accuracy.main(["--quick", "--seeds", "0", "--methods", "full,paper@0.7+q8"]) == 0
    out = capsys.readouterr().out
    assert "| full | 0 |" in out and "| paper@0.7+q8 | 0 |" in out and "+0.00%" in out


def test_method_specs():
    assert decoder_accuracy._method("full") == (None, 0.0, {})
    unnamed = {"update_scale": "none", "state_code": "linear8", "warmup_steps": 0}   # bench.accuracy.SPEC_DEFAULTS
    assert decoder_accuracy._method("paper@0.9+q8") == ("paper", 0.9, {"frozen_state": "compress", **unnamed})
    assert decoder_accuracy._method("paper@0.7+q8all+scale+dyn8") == (
        "paper", 0.7, {"frozen_state": "compress_all", "update_scale": "share", "state_code": "dynamic8",
                       "warmup_steps": 0})
    assert decoder_accuracy._method("paper@0.7+warm250+from35")[2]["warmup_start_rate"] == 0.35


def test_fortunes_quick_run_scores_zero_shot_and_records_train_losses(fortune_dir, capsys, monkeypatch):
    rows, render = [], decoder_accuracy.markdown_fortunes
    monkeypatch.setattr(decoder_accuracy, "markdown_fortunes", lambda done: render(rows.extend(done) or done))
    assert decoder_accuracy.main(["--task", "fortunes", "--quick", "--seeds", "0",
                                  "--methods", "full,paper@0.7+q8all"]) == 0
    assert [r["method"] for r in rows] == ["zero-shot", "full", "paper@0.7+q8all"]
    shot, full, slim = rows
    assert shot["steps"] == "0" and shot["n_test"] == 16 and full["n_test"] == 16 and full["steps"] == "3"
    assert len(slim["train_losses"].split()) == 3 and float(slim["train_loss_first10"]) > 0
    assert float(slim["frozen_share"]) > 0 and float(full["frozen_share"]) == 0
    out = capsys.readouterr().out
    assert "zero-shot: loss" in out and "Zero-shot (the pretrained model" in out
    assert "| full | 3, 2, 5e-05, 96 | 0 |" in out and "| paper@0.7+q8all | 3, 2, 5e-05, 96 | 0 |" in out


def _bitsandbytes_or_skip():
    try:
        import bitsandbytes  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not usable here
        pytest.skip(f"bitsandbytes is not installed or does not import ({type(e).__name__}: {e}); "
                    "pip install bitsandbytes")


def test_full_bnb8_is_full_fine_tuning_with_adamw8bit_at_the_loops_hyperparameters():
    from slimfit.training.finetune import _adamw

    assert decoder_accuracy._method("full+bnb8") == (None, 0.0, {})
    assert accuracy.spec_optimizer("full") is None and accuracy.spec_optimizer("paper@0.7+q8all") is None
    with pytest.raises(SystemExit, match=r"unknown option \+bnb8"):
        accuracy.parse_spec("paper@0.7+bnb8")
    _bitsandbytes_or_skip()
    model = torch.nn.Linear(128, 64)
    _, plain = _adamw(model, None, 3e-5)
    _, bnb8 = _adamw(model, None, 3e-5, accuracy.spec_optimizer("full+bnb8"))
    assert type(bnb8).__name__ == "AdamW8bit" and type(bnb8).__module__.startswith("bitsandbytes")
    same = ("lr", "betas", "eps", "weight_decay")
    assert {k: bnb8.defaults[k] for k in same} == {k: plain.defaults[k] for k in same}
    model(torch.randn(4, 128)).sum().backward()
    bnb8.step()
    assert bnb8.state[model.weight]["state1"].dtype == torch.uint8     # 8,192 elements: over min_8bit_size


def test_full_bnb8_without_bitsandbytes_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)               # import bitsandbytes -> ImportError
    for check in (lambda: accuracy.method_prepare("full+bnb8"), lambda: accuracy.spec_optimizer("full+bnb8")):
        with pytest.raises(SystemExit, match="pip install bitsandbytes"):
            check()


def test_fortunes_quick_run_of_full_bnb8(fortune_dir, monkeypatch):
    _bitsandbytes_or_skip()
    rows, render = [], decoder_accuracy.markdown_fortunes
    monkeypatch.setattr(decoder_accuracy, "markdown_fortunes", lambda done: render(rows.extend(done) or done))
    assert decoder_accuracy.main(["--task", "fortunes", "--quick", "--seeds", "0", "--methods", "full+bnb8"]) == 0
    assert [r["method"] for r in rows] == ["zero-shot", "full+bnb8"]
    bnb8 = rows[1]
    assert len(bnb8["train_losses"].split()) == 3 and float(bnb8["frozen_share"]) == 0
    assert 0.0 <= float(bnb8["accuracy"]) <= 1.0 and float(bnb8["heldout_loss"]) > 0


def test_fortunes_markdown_pairs_with_full_and_shows_zero_shot(fortune_dir):
    rows = []
    for method, seed, acc, loss in [("full", 0, 0.5, 1.0), ("full", 1, 0.6, 0.9), ("paper@0.7+q8all", 0, 0.4, 1.1),
                                    ("paper@0.7+q8all", 1, 0.55, 1.0)]:
        rows.append({"method": method, "seed": str(seed), "steps": "40", "batch_size": "8", "lr": "5e-05",
                     "max_length": "96", "n_train": "2000", "n_test": "160", "heldout_loss": str(loss),
                     "accuracy": str(acc), "train_loss_first10": "3.0", "train_loss_last10": "1.5", "step_ms": "900",
                     "run_s": "120", "whole_share": "0.910", "date": "d"})
    rows.insert(0, dict(rows[0], method="zero-shot", seed="-", steps="0", accuracy="0.1", heldout_loss="4.0"))
    text = decoder_accuracy.markdown_fortunes(rows)
    assert "Zero-shot (the pretrained model, no step; <= 96 tokens, 160 held-out): accuracy 10.00%" in text
    assert "| paper@0.7+q8all | 40, 8, 5e-05, 96 | 0,1 |" in text
    assert "-7.50 (-10.00, -5.00)" in text and "+10.56%" in text


def test_fortune_split_is_balanced_and_checks_the_topics(fortune_dir):
    train, test = decoder_accuracy.fortune_split(n_train=50, n_test=32)
    assert len(train) == 50 and len(test) == 32
    assert sorted(y for _, y in test) == sorted(list(range(16)) * 2)
    assert not set(train) & set(test)
    names = [t for t, _ in decoder_accuracy.FORTUNE_TOPICS]
    assert all(text.startswith(names[y] + " saying") for text, y in train + test)
    (fortune_dir / "tiny").write_text("\n%\n".join(f"t {k}" for k in range(40)))   # now the largest file
    with pytest.raises(SystemExit, match="update FORTUNE_TOPICS"):
        decoder_accuracy.fortune_split(n_train=50, n_test=32)
