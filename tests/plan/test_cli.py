"""`slimfit plan`: the command's output and errors, wired into slimfit/cli.py."""
from __future__ import annotations

import pytest

from slimfit import cli
from slimfit.memory.units import parse_bytes


def test_plan_prints_the_peak_and_its_parts(capsys):
    rc = cli.main(["plan", "bert-tiny", "--batch", "2", "--seq", "32", "--preset", "paper", "--rate", "0.5"])
    out = capsys.readouterr().out
    assert rc == 0
    for text in ("slimfit plan: bert-tiny", "paper, rate 0.5", "ILSScheduler:", "predicted step peak", "weights",
                 "gradients", "optimizer state", "saved activations", "transient", "peak in", "estimated step time"):
        assert text in out, text


def test_plan_errors_exit_2_with_the_reason(capsys):
    assert cli.main(["plan", "bert-tiny", "--batch", "2"]) == 2
    assert "give seq" in capsys.readouterr().err
    assert cli.main(["plan", "bert-tiny", "--batch", "2", "--seq", "8", "--rate", "0.5", "--lora", "4"]) == 2
    assert "LoRA" in capsys.readouterr().err
    assert cli.main(["plan", "no-such-model-anywhere", "--batch", "1", "--seq", "8"]) == 2
    assert "local cache" in capsys.readouterr().err


@pytest.mark.parametrize("text, value", [("24GiB", 24 * 2**30), ("24G", 24 * 2**30), ("16GB", 16 * 10**9),
                                         ("512MiB", 512 * 2**20), ("1e9", 10**9), ("1.5 GiB", 3 * 2**29)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_parse_bytes_refuses_what_is_not_a_size():
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("24 parsecs")
