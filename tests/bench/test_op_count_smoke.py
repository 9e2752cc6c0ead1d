"""bench/op_count.py (bench.op_count) must keep running: its --quick path (one-layer BERT and Llama, tiny shapes, CPU).

Checks that every configuration and module kind is counted and written (CSV, Markdown), that the counter
sees what it should (a frozen patched linear saves nothing and dispatches no weight-gradient GEMM), and that
the figures this change was about hold: a LayerNorm normalizes once in forward, and GELU's backward writes
its result over the dequantized input."""
from __future__ import annotations

import csv

import pytest

pytest.importorskip("transformers")

from bench import op_count  # noqa: E402


@pytest.fixture(scope="module")
def quick_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("op_count")
    assert op_count.main(["--quick", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def rows(quick_out):
    out = quick_out
    with open(out / "op_count_cpu.csv", newline="") as fh:
        got = {(r["model"], r["weights"], r["kind"], r["config"]): r for r in csv.DictReader(fh)}
    return got, (out / "op_count_cpu.md").read_text()


def test_every_kind_and_config_is_counted(rows):
    got, md = rows
    kinds = {"bert": ("linear", "gelu", "layernorm", "dropout", "attention core", "layer"),
             "llama": ("linear", "rmsnorm", "swiglu", "attention core", "layer")}
    for model, ks in kinds.items():
        for weights in op_count.WEIGHTS:
            for kind in ks:
                for config in op_count.CONFIGS:
                    r = got[(model, weights, kind, config)]
                    assert int(r["fwd_ops"]) > 0 and int(r["bwd_ops"]) > 0, (model, weights, kind, config)
                    assert int(r["total_ops"]) == int(r["fwd_ops"]) + int(r["bwd_ops"])
    assert "## Whole layer" in md and "attention core" in md and "Ops beyond eager's" in md


def test_counts_see_the_frozen_fast_path(rows):
    got, _ = rows
    for config in op_count.PATCHED:
        frozen = got[("bert", "frozen", "linear", config)]
        assert int(frozen["saved_bytes"]) == 0
        bwd = op_count._parse_ops(frozen["bwd_detail"])
        assert bwd["aten.mm"] == int(frozen["modules"])  # input gradient only, no weight-gradient GEMM
        trainable = op_count._parse_ops(got[("bert", "trainable", "linear", config)]["bwd_detail"])
        assert trainable["aten.mm"] == 2 * int(frozen["modules"])


def test_layernorm_normalizes_once_and_gelu_backward_reuses_its_buffer(rows):
    from slimfit.autograd import layernorm

    got, _ = rows
    # one normalizing pass per LayerNorm where this build's addcmul gives F.layer_norm's bits (fp32 CPU)
    passes = 1 if layernorm._ADDCMUL_IS_LAYER_NORM else 2
    for weights in op_count.WEIGHTS:
        for config in op_count.PATCHED:
            ln = got[("bert", weights, "layernorm", config)]
            fwd = op_count._parse_ops(ln["fwd_detail"])
            assert fwd["aten.native_layer_norm"] == passes * int(ln["modules"])
            assert fwd["aten.view"] == 0
            bwd = op_count._parse_ops(got[("bert", weights, "gelu", config)]["bwd_detail"])
            assert bwd["aten.gelu_backward.grad_input"] == 1 and bwd["aten.gelu_backward"] == 0


def test_render_only_rebuilds_the_markdown_from_the_csv(quick_out, tmp_path):
    """--render-only counts nothing: the same Markdown from the CSV, header kept; --before adds the other
    run's columns (here the run itself) and names it in the header and the command."""
    import shutil

    for ext in ("csv", "md"):
        shutil.copy(quick_out / f"op_count_cpu.{ext}", tmp_path / f"op_count_cpu.{ext}")
    counted = (tmp_path / "op_count_cpu.md").read_text()
    other = str(quick_out / "op_count_cpu.csv")
    assert op_count.main(["--render-only", "--out", str(tmp_path), "--before", other]) == 0
    compared = (tmp_path / "op_count_cpu.md").read_text()
    assert "'before' columns: the counts of commit" in compared and "before: total (ratio)" in compared
    assert f"--before {other}`" in compared
    assert op_count.main(["--render-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "op_count_cpu.md").read_text() == counted
