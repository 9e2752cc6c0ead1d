"""bench/kernels.py must keep running: its --quick logic in-process on tiny sizes, on the CPU.

This checks that the benchmark completes and writes its results, not any timing."""
from __future__ import annotations

import csv
import importlib.util
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "kernels.py")


@pytest.fixture(scope="module")
def bench_kernels():
    spec = importlib.util.spec_from_file_location("slimfit_bench_kernels", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_quick_run_writes_csv_and_markdown(bench_kernels, tmp_path, capsys):
    rows = bench_kernels.main(["--quick", "--device", "cpu", "--numel", "2048", "--out-dir", str(tmp_path)])

    assert {r.op for r in rows} == set(bench_kernels.OPS)
    assert not [r for r in rows if r.error], [(r.op, r.backend, r.error) for r in rows if r.error]
    reference_rows = [r for r in rows if r.backend == "reference"]
    assert reference_rows and all(r.speedup_vs_ref == pytest.approx(1.0) for r in reference_rows)
    assert all(r.ms > 0 and r.gbps > 0 and r.copy_gbps > 0 and r.pct_copy > 0 for r in rows)

    with open(tmp_path / "kernels_cpu.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    for column in ("device", "op", "backend", "config", "numel", "dtype", "ms", "gbps", "pct_copy",
                   "speedup_vs_ref", "torch", "triton", "device_name"):
        assert all(line[column] != "" for line in table), column
    assert {line["dtype"] for line in table} == {"fp32", "bf16", "bool"}

    md = (tmp_path / "kernels_cpu.md").read_text()
    assert md.startswith("# slimfit kernel benchmark: CPU")
    assert "| op | backend |" in md and "Targets" in md
    assert "quantize" in capsys.readouterr().out  # the table went to stdout


def test_partial_run_writes_nothing_by_default(bench_kernels, tmp_path, monkeypatch):
    results = tmp_path / "results"
    monkeypatch.setattr(bench_kernels, "RESULTS_DIR", str(results))
    rows = bench_kernels.main(["--quick", "--device", "cpu", "--numel", "1000", "--ops", "pack_bits,topk_prune",
                               "--dtype", "fp32", "--cpu-timer", "process"])
    assert {r.op for r in rows} == {"pack_bits", "topk_prune"}
    assert {r.timer for r in rows} == {"process_time"}
    assert not results.exists()


def test_byte_counts_are_exact(bench_kernels):
    import torch

    cases = bench_kernels.build_cases(bench_kernels.OPS, 1000, ["bf16"], torch.device("cpu"))
    by = {(c.op, c.config): c for c in cases}
    q = by[("quantize", "4-bit g128 nearest")]
    assert (q.bytes_read, q.bytes_written) == (2000, 500 + 8 * 8)      # 8 groups: fp32 scale + offset
    d = by[("dequantize", "2-bit g128")]
    assert (d.bytes_read, d.bytes_written) == (250 + 8 * 8, 2000)
    t = by[("topk_prune", "row 128 keep 13 |x|")]                       # 7 rows of 128, int16 indices
    assert (t.numel, t.bytes_read, t.bytes_written) == (896, 896 * 2, 7 * 13 * (2 + 2))
    p = by[("pack_bits", "1 bit/element")]
    assert (p.bytes_read, p.bytes_written) == (1000, 125)
    b = by[("quantize_blockwise", "4-bit signed b128")]                   # 16-level map read: 64 bytes
    assert (b.bytes_read, b.bytes_written) == (2000 + 64, 500 + 4 * 8)   # 8 blocks: one fp32 absmax each
    b = by[("quantize_blockwise", "8-bit unsigned b128 stochastic")]    # the map and its inverse gaps read
    assert (b.bytes_read, b.bytes_written) == (2000 + 2048, 1000 + 4 * 8) and b.args[3:] == (True, bench_kernels.SEED)
    b = by[("dequantize_blockwise", "8-bit unsigned b128")]
    assert (b.bytes_read, b.bytes_written) == (1000 + 4 * 8 + 1024, 2000)
