"""bench/step_ops.py (bench.step_ops) must keep running: its --quick path (bert-tiny and llama-tiny, every row,
the CPU and the fake-cuda device), the CSV and Markdown it writes, and --render-only from that CSV."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bench import _results, step_ops  # noqa: E402


@pytest.fixture(scope="module")
def quick_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("step_ops")
    assert step_ops.main(["--quick", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def rows(quick_out):
    got = {(r["device"], r["model"], r["row"]): r for r in _results.read_rows(str(quick_out / "step_ops_cpu.csv"))}
    return got, (quick_out / "step_ops_cpu.md").read_text()


def test_every_row_and_phase_is_counted_on_the_cpu(rows):
    got, md = rows
    for model in step_ops.QUICK_MODELS:
        for row in step_ops.ROWS:
            r = got[("cpu", model, row)]
            for phase in ("forward", "backward", "optimizer"):
                assert int(r[phase]) > 0, (model, row, phase)
            counted = [int(r[p]) for p in step_ops.PHASES if r[p] != ""]
            assert int(r["total"]) == sum(counted)
            assert (r["scheduler"] != "") == (row in step_ops.SLIMFIT_ROWS)
        assert got[("cpu", model, "plain")]["ratio_total"] == "1.00x"
    assert "## Ops per phase of one steady-state step" in md and "slimfit's optimizer step" in md
    assert "Command: `python bench/step_ops.py --quick --out" in md


def test_the_counter_sees_the_steps_it_should(rows):
    """Plain's optimizer step is torch's foreach AdamW (multi-tensor ops, no per-parameter update); checkpointing
    recomputes in backward; slimfit's default step steps the 8-bit moments (block-wise dynamic codes, the
    default state_code) by one fused op per call, without a separate decode or encode."""
    got, _ = rows
    for model in step_ops.QUICK_MODELS:
        plain = step_ops._parse_detail(got[("cpu", model, "plain")]["optimizer_detail"])
        assert plain["aten._foreach_addcdiv_.ScalarList"] == 1 and "aten.addcdiv_" not in plain
        ckpt = got[("cpu", model, "checkpointing")]
        assert int(ckpt["backward"]) > int(got[("cpu", model, "plain")]["backward"])
        slim = step_ops._parse_detail(got[("cpu", model, "slimfit")]["optimizer_detail"])
        assert slim["slimfit.adam_blockwise_"] > 0
        assert slim["slimfit.quantize_blockwise"] == 0 and slim["slimfit.dequantize_blockwise"] == 0
        full = step_ops._parse_detail(got[("cpu", model, "slimfit-full-state")]["optimizer_detail"])
        assert full["slimfit.quantize_blockwise"] == 0 and full["slimfit.quantize"] == 0
        assert full["slimfit.adam_blockwise_"] == 0


def test_fake_cuda_counts_the_optimizer_and_scheduler_on_a_device(rows):
    """fake-cuda: no forward or backward; the optimizer's host-side ops (AdamW's step counters) are not launches,
    so plain's foreach step is a handful of multi-tensor ops; slimfit's chunked step takes its device branch."""
    got, md = rows
    for model in step_ops.QUICK_MODELS:
        plain = got[("fake-cuda", model, "plain")]
        assert plain["forward"] == "" and plain["backward"] == ""
        assert 0 < int(plain["optimizer"]) <= 10 and int(plain["host_ops"]) > 0
        assert ("fake-cuda", model, "checkpointing") not in got
        slim = got[("fake-cuda", model, "slimfit")]
        assert int(slim["scheduler"]) > 0 and int(slim["optimizer"]) > 0
        detail = step_ops._parse_detail(slim["optimizer_detail"])
        # the device branch: the op scores the trained pieces itself (their block sums summed by one foreach op),
        # no copy of their old weights
        assert detail["slimfit.adam_blockwise_"] > 0 and detail["aten._foreach_norm.Scalar"] > 0
        assert detail["aten.cat"] == 0
    assert "fake-cuda rows:" in md


def test_render_only_rebuilds_the_markdown_from_the_csv(quick_out, tmp_path):
    import shutil

    for ext in ("csv", "md"):
        shutil.copy(quick_out / f"step_ops_cpu.{ext}", tmp_path / f"step_ops_cpu.{ext}")
    counted = (tmp_path / "step_ops_cpu.md").read_text()
    assert step_ops.main(["--render-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "step_ops_cpu.md").read_text() == counted
