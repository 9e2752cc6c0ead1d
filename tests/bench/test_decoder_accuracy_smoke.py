"""bench/decoder_accuracy.py: the quick run (a tiny random Llama, 3 steps) trains every method and the table
compares each with full fine-tuning over the same seeds."""
from bench import decoder_accuracy


def test_quick_run_prints_the_comparison(capsys):
    assert decoder_accuracy.main(["--quick", "--seeds", "0", "--methods", "full,paper@0.7+q8"]) == 0
    out = capsys.readouterr().out
    assert "| full | 0 |" in out and "| paper@0.7+q8 | 0 |" in out and "+0.00%" in out


def test_method_specs():
    assert decoder_accuracy._method("full") == (None, 0.0, {})
    assert decoder_accuracy._method("paper@0.9+q8") == ("paper", 0.9, {"frozen_state": "compress"})
