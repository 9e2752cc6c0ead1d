"""`slimfit memory <architecture>` (slimfit/memory_cli.py) on the hidden tiny architecture."""
from __future__ import annotations

import argparse
import re

import pytest

pytest.importorskip("transformers")

from slimfit.memory.cli import MEMORY as memory_cli  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors: threads only add barrier waits (badly so on a shared, busy machine)."""


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="slimfit memory")
    memory_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def _ratio(out: str) -> float:
    m = re.search(r"^reduction vs plain: ([0-9.]+)x", out, re.MULTILINE)
    assert m, out
    return float(m.group(1))


def _bytes(out: str, label: str) -> float:
    m = re.search(re.escape(label) + r"\s+([0-9.,]+) (KiB|MiB|GiB)", out)
    assert m, out
    return float(m.group(1).replace(",", "")) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(2)]


def test_paper_report_names_modules_and_saves(capsys):
    rc = memory_cli.run(_args("bert-tiny", "--batch", "2", "--seq-len", "16"))
    out = capsys.readouterr().out
    assert rc == 0
    # The per-module table of slimfit.memory.report, with the baseline columns.
    assert re.search(r"^module\s+saved\s+share\s+baseline\s+reduction", out, re.MULTILINE)
    for module in ("bert.encoder.layer.0.attention.self", "bert.encoder.layer.1.intermediate.intermediate_act_fn",
                   "bert.encoder.layer.1.output.LayerNorm"):
        assert module in out
    assert "family: bert" in out and "attention: sdpa" in out
    assert _ratio(out) > 1.0
    plain = _bytes(out, "plain PyTorch, all trainable")
    frozen = _bytes(out, "plain PyTorch, same layers frozen")
    patched = _bytes(out, "slimfit paper(), same layers frozen")
    assert patched < frozen <= plain
    # The frozen set is the scheduler's at its default rate: 70% of bert-tiny's 13 weight matrices below the
    # head (of 22 candidates, the 3 embedding tables, 5 LayerNorm weights and the classifier train every step).
    assert "frozen: 9 of 13 scheduled layers" in out
    _check_step_peaks(out)


_UNIT = r"([0-9.,]+ (?:KiB|MiB|GiB))"


def _peak_row(out: str, label: str) -> list[float]:
    """step peak, weights, gradients, optimizer, saved, transient, at entry (bytes) of one row of the
    total-step-peak table (the row after the table's title: the same label heads a Totals row above)."""
    table = out.split("Total step peak (", 1)[1]
    m = re.search(r"^\s+" + re.escape(label) + r"\s+" + r"\s+".join([_UNIT] * 7), table, re.MULTILINE)
    assert m, out
    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    return [float(g.split()[0].replace(",", "")) * scale[g.split()[1]] for g in m.groups()]


def _check_step_peaks(out: str) -> None:
    plain, frozen, patched = (_peak_row(out, label) for label in (
        "plain PyTorch, all trainable", "plain PyTorch, same layers frozen", "slimfit paper(), same layers frozen"))
    for row in (plain, frozen, patched):
        assert abs(sum(row[1:6]) - row[0]) <= 0.02 * row[0]  # the parts sum to the peak (shown rounded)
        assert row[6] < row[0]  # the step rises above what it finds resident
    assert plain[1] == frozen[1] == patched[1]  # the same weights
    assert plain[2] > frozen[2] and plain[3] > frozen[3]  # frozen layers: no gradient, no AdamW moments
    assert frozen[0] < plain[0] and patched[0] < plain[0]
    # the scheduler's frozen layers keep their AdamW state (made when they trained); static freezing has none
    assert patched[3] == plain[3] and patched[2] == frozen[2]
    assert re.search(r"^step peak reduction vs plain: [0-9.]+x \(freezing alone: [0-9.]+x\)", out, re.MULTILINE)


@pytest.mark.parametrize("preset,dtype", [("exact", "fp32"), ("aggressive", "bf16")])
def test_presets_dtype_and_collapsed_rows(capsys, preset, dtype):
    rc = memory_cli.run(_args("BERT_tiny", "--seq-len", "8", "--preset", preset, "--dtype", dtype,
                              "--collapse-layers"))
    out = capsys.readouterr().out
    assert rc == 0
    assert "bert.encoder.layer.*.attention.self" in out and "bert.encoder.layer.0." not in out
    assert ("bf16 autocast" in out) == (dtype == "bf16")
    assert _ratio(out) > 1.0


def test_no_freezing_still_saves_with_paper(capsys):
    rc = memory_cli.run(_args("bert-tiny", "--seq-len", "8", "--freeze-rate", "0", "--saved-only"))
    out = capsys.readouterr().out
    assert rc == 0
    assert "frozen: 0 of 13" in out
    assert _ratio(out) > 1.0
    assert "Total step peak" not in out  # --saved-only


def test_unknown_architecture_lists_known_ones(capsys):
    rc = memory_cli.run(_args("bert-huge"))
    err = capsys.readouterr().err
    assert rc == 2
    assert "unknown architecture 'bert-huge'" in err
    for name in ("bert-base", "bert-large", "roberta-base", "distilbert", "vit-base", "vit-large", "gpt2"):
        assert name in err
    assert "bert-tiny" not in err  # hidden test entry


@pytest.mark.parametrize("argv,message", [
    (("bert-tiny", "--seq-len", "4096"), "seq-len must be in [1, 128]"),
    (("bert-tiny", "--freeze-rate", "1.0"), "--freeze-rate must be in [0, 1)"),
    (("bert-tiny", "--image-size", "224"), "--image-size applies to vision models"),
    (("bert-tiny", "--batch", "0"), "batch must be >= 1"),
])
def test_bad_arguments_are_clear_errors(capsys, argv, message):
    assert memory_cli.run(_args(*argv)) == 2
    assert message in capsys.readouterr().err


def _row(out: str, module: str) -> tuple[float, float]:
    """(saved, baseline) bytes of one per-module row."""
    unit = r"([0-9.,]+ (?:B|KiB|MiB|GiB))"
    m = re.search(r"^" + re.escape(module) + r"\s+" + unit + r"\s+\S+\s+" + unit, out, re.MULTILINE)
    assert m, out
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}

    def num(text):
        value, u = text.split()
        return float(value.replace(",", "")) * scale[u]

    return num(m.group(1)), num(m.group(2))


def test_llama_path_per_module_swiglu_rmsnorm_head_and_rope_untouched(capsys):
    """The Llama path end to end (issue 14): SwiGLU and RMSNorm compressed as paper() says, the LM head's
    logits gone from (root), RoPE left alone; all visible per module."""
    rc = memory_cli.run(_args("llama-tiny", "--seq-len", "64", "--collapse-layers"))
    out = capsys.readouterr().out
    assert rc == 0
    assert "swiglu[gate and up 4-bit]" in out and "rmsnorm[int8/int8 when frozen]" in out
    assert "causal-lm loss[chunked linear + cross-entropy" in out
    assert "rotary" not in out.split("Saved for backward")[0]  # nothing of RoPE patched or skipped
    assert "RoPE) are computed as in transformers" in out
    mlp, mlp_base = _row(out, "model.layers.*.mlp")
    assert mlp * 3 < mlp_base  # gate and up at 4 bits vs gate, silu(gate), up in fp32
    act, act_base = _row(out, "model.layers.*.mlp.act_fn")
    assert act == 0 and act_base > 0  # the product is computed by the patched MLP itself
    root, root_base = _row(out, "(root)")
    assert root_base >= 64 * 1000 * 4 and root * 10 < root_base  # fp32 logits (seq x vocab 1000) gone
