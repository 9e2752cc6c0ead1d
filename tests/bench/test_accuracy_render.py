"""bench/accuracy.py's Markdown: one table per protocol, gaps paired within a protocol only."""
from __future__ import annotations

from bench import accuracy


def _row(method, seed, steps, acc, saved=100.0, lr="0.0001"):
    return {"task": "t", "method": method, "seed": str(seed), "steps": str(steps), "batch_size": "32", "lr": lr,
            "max_length": "48", "n_train": "8000", "n_test": "2000", "accuracy": str(acc),
            "saved_mib": str(saved), "peak_mib": "", "step_ms": "10.0", "frozen_share": "0.0",
            "trainable_params": "100", "loss_first10": "0.7", "loss_last10": "0.5", "device": "cpu",
            "torch": "x", "date": "d"}


def test_each_protocol_gets_its_own_table_and_paired_gap():
    rows = [_row("full", 0, 150, 0.80), _row("paper@0.9", 0, 150, 0.70, saved=10.0),
            _row("full", 0, 750, 0.84), _row("paper@0.9", 0, 750, 0.83, saved=10.0),
            _row("lora", 0, 750, 0.82, lr="0.0005")]
    md = accuracy.render_markdown(rows, "# title", lambda n: f"seq <= {n}")
    short, long = md.split("## 150 steps")[1].split("## 750 steps")
    assert "(0.6 epochs of 8,000; 2,000 test)" in short and "(3 epochs of 8,000" in long
    assert "| paper@0.9 | 0 | 70.00 | -10.00 | 10.0 | 10.0x |" in short
    assert "| paper@0.9 | 0 | 83.00 | -1.00 | 10.0 | 10.0x |" in long
    assert "| lora |" in long and "| lora |" not in short
    assert "full/paper@0.9 0.0001" in long and "lora 0.0005" in long


def test_full_fine_tuning_heads_each_table():
    rows = [_row("paper@0.9", 0, 500, 0.80), _row("full", 0, 500, 0.82), _row("aggressive@0.9", 0, 500, 0.81)]
    md = accuracy.render_markdown(rows, "# title", lambda n: f"seq <= {n}")
    order = [line.split("|")[1].strip() for line in md.splitlines() if line.startswith("| ") and "---" not in line]
    assert order == ["method", "full", "paper@0.9", "aggressive@0.9"]


def test_head_suffix_only_on_scheduled_methods():
    import pytest

    for spec in ("paper@0.9+head", "exact@0.5+head", "wta_crs@0.9+head"):
        prepare, few_params_lr = accuracy.method_prepare(spec)
        assert callable(prepare) and not few_params_lr
    with pytest.raises(SystemExit, match="apply to the scheduled methods"):
        accuracy.method_prepare("lora+head")
    with pytest.raises(SystemExit, match="unknown option"):
        accuracy.method_prepare("paper@0.9+fast")


def test_parse_spec():
    assert accuracy.parse_spec("paper@0.9+head") == ("paper", 0.9, {"head": True})
    assert accuracy.parse_spec("wta_crs@0.5") == ("wta_crs", 0.5, {})
    assert accuracy.parse_spec("lora") == ("lora", None, {})
    assert accuracy.parse_spec("paper+lora") == ("paper+lora", None, {})
    assert accuracy.parse_spec("paper_pint8@0.9+head+mom+warm10+min5") == (
        "paper_pint8", 0.9, {"head": True, "frozen_update": "momentum", "warmup_share": 0.1, "min_train_share": 0.05})


def test_a_method_at_two_learning_rates_is_two_rows_paired_at_its_own_lr():
    rows = [_row("full", 0, 500, 0.80), _row("full", 1, 500, 0.82),
            _row("paper@0.7", 0, 500, 0.79), _row("paper@0.7", 1, 500, 0.81),
            _row("full", 0, 500, 0.84, lr="0.0002"), _row("paper@0.7", 0, 500, 0.85, lr="0.0002"),
            _row("paper@0.9", 0, 500, 0.78, lr="0.0002"),  # no full at this lr on seed 1: paired at 1e-4 too
            _row("lora", 0, 500, 0.83, lr="0.0005")]
    md = accuracy.render_markdown(rows, "# title", lambda n: f"seq <= {n}")
    lines = [line for line in md.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [line.split("|")[1].strip() for line in lines] == [
        "full, lr 0.0001", "full, lr 0.0002", "paper@0.7, lr 0.0001", "paper@0.7, lr 0.0002", "paper@0.9", "lora"]
    gap = {line.split("|")[1].strip(): line.split("|")[4].strip() for line in lines}
    assert gap["full, lr 0.0002"] == "+4.00"        # against full at its usual lr (1e-4, two seeds)
    assert gap["paper@0.7, lr 0.0001"] == "-1.00"   # same lr
    assert gap["paper@0.7, lr 0.0002"] == "+1.00"   # against full at 2e-4, not 1e-4 (that would say +5.00)
    assert gap["paper@0.9"] == "-6.00"              # full ran at 2e-4 on seed 0
    assert gap["lora"] == "+3.00"                   # no full at 5e-4: the usual lr


def test_every_committed_row_names_a_method_this_script_runs():
    """The committed results stay readable: each row's method is a spec bench/accuracy.py knows (no
    retired names kept as aliases), so --render-only and --help describe every row."""
    import os

    from bench import _results

    names = set()
    for task in ("text", "fortunes", "fashion_mnist"):
        names |= {r["method"] for r in _results.read_rows(os.path.join(_results.RESULTS_DIR,
                                                                        f"accuracy_{task}_cpu.csv"))}
    assert len(names) > 20
    for spec in sorted(names):
        prepare, _ = accuracy.method_prepare(spec, steps=500)
        assert callable(prepare), spec
