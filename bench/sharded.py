#!/usr/bin/env python
"""The whole step's peak per rank under FSDP2 (``fully_shard``): N processes over gloo on the CPU, each rank
measured (slimfit.step_memory), the largest reported with every rank's beside it.

    python -m bench.sharded                          # bert-16 and smollm2-2048 at N = 1, 2, 4: appends to
                                                     # bench/results/sharded_cpu.csv (resumable: rows already
                                                     # there are skipped) and rewrites sharded_cpu.md
    python -m bench.sharded --cases bert-16 --world-sizes 2 --methods fsdp2,fsdp2+slimfit
    python -m bench.sharded --cases qwen0.5b-1024 --world-sizes 2   # the Qwen2.5-0.5B shape (fp32), b1 s1024
    python -m bench.sharded --quick                  # 2-layer models, tiny shapes, N = 1, 2: writes nothing
    python -m bench.sharded --render-only

Methods (a fresh model on every rank, the same random weights; each transformer block and the root wrapped by
``fully_shard``; AdamW at lr 0, so every row sees the same weights; the batch is per rank, each rank its own):
  fsdp2           plain FSDP2, PyTorch's SDPA attention
  fsdp2+ckpt      the same with gradient checkpointing of every layer (use_reentrant=False)
  fsdp2+slimfit   slimfit.patch(paper()) then fully_shard, ILSScheduler with its defaults at rate 0.7 (every
                  moment held 8-bit per shard under the chunked step; warmup_steps=0: the steady state)

Per rank: two steps first (AdamW's state made, the scheduler's frozen set and held moments in place), then the
measured step, then the median of two timed steps without tracking. The CPU's cores are shared by the N
processes (threads per process: cores / N), so a step time compares rows of one world size only.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/sharded.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import dataclasses
import json
import os
import socket
import statistics
import tempfile
import time

import torch

from bench import _results
from slimfit import architectures as archs

MiB = 2 ** 20
CASES = {"bert-16": ("bert-base", 16, 128), "smollm2-2048": ("smollm2-135m", 1, 2048),
         "qwen0.5b-1024": ("qwen2.5-0.5b", 1, 1024)}
QUICK_CASES = {"bert-16": ("bert-base", 2, 32), "smollm2-2048": ("smollm2-135m", 1, 64),
               "qwen0.5b-1024": ("qwen2.5-0.5b", 1, 64)}
# run by default; the 0.5B shape only when named (N = 2 here: plain FSDP2's four ranks of ~5 GiB exceed 24 GiB)
DEFAULT_CASES = ("bert-16", "smollm2-2048")
METHODS = ("fsdp2", "fsdp2+ckpt", "fsdp2+slimfit")
PARTS = ("weights", "gradients", "optimizer_state", "saved", "transient")
PREDICTED = {"fsdp2": {}, "fsdp2+ckpt": {"checkpointing": True}, "fsdp2+slimfit": {"preset": "paper", "rate": 0.7}}
FIELDS = ["case", "model", "batch_per_rank", "seq", "world", "method", "status", "rank_peak_mib", "predicted_mib",
          "rank_peaks_mib",
          "weights_mib", "gradients_mib", "optimizer_mib", "saved_mib", "transient_mib", "peak_phase", "step_s",
          "threads", "device_name", "torch", "date", "commit"]


@dataclasses.dataclass
class Spec:
    case: str
    arch: str
    batch: int
    seq: int
    world: int
    method: str
    quick: bool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(spec: Spec, rank: int):
    """(model, inputs, optimizer, after_step) of one rank: built, patched, sharded."""
    import slimfit
    from bench.frontier import _checkpointing
    from slimfit.config import SlimFitConfig
    from slimfit.memory.plan.sharding import shard

    arch = archs.resolve(spec.arch)
    if spec.quick:
        arch = dataclasses.replace(arch, config={**arch.config, "num_hidden_layers": 2})
    model = archs.build(arch, attn_implementation="sdpa", seed=0)
    inputs = archs.make_inputs(model, arch.task, spec.batch, spec.seq, None, seed=rank)
    if spec.method == "fsdp2+ckpt":
        _checkpointing(model)
    if spec.method == "fsdp2+slimfit":
        slimfit.patch(model, SlimFitConfig.preset("paper"))
    shard(model, None)   # the plan's wrapping (every transformer layer, then the root), on the default mesh
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    after = None
    if spec.method == "fsdp2+slimfit":
        from slimfit.scheduler import ILSScheduler

        after = ILSScheduler(model, optimizer=optimizer, seed=0, warmup_steps=0).step
    return model, inputs, optimizer, after


def _step(model, inputs, optimizer, after) -> None:
    model(**inputs).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if after is not None:
        after()


def _worker(rank: int, spec: Spec, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from slimfit.memory import measure_step

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world))
    dist.init_process_group("gloo", rank=rank, world_size=spec.world)
    try:
        model, inputs, optimizer, after = _model(spec, rank)
        for _ in range(2):
            _step(model, inputs, optimizer, after)
        mem = measure_step(model, inputs, optimizer, after_step=after)
        times = []
        for _ in range(2):
            dist.barrier()
            t0 = time.perf_counter()
            _step(model, inputs, optimizer, after)
            times.append(time.perf_counter() - t0)
        result = {"peak": mem.total, "phase": mem.peak_phase, **{p: getattr(mem, p) for p in PARTS},
                  "step_s": statistics.median(times), "threads": torch.get_num_threads()}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def measure_row(spec: Spec) -> dict:
    import torch.multiprocessing as mp

    versions = _results.versions()
    row = {"case": spec.case, "model": spec.arch, "batch_per_rank": spec.batch, "seq": spec.seq,
           "world": spec.world, "method": spec.method, "status": "ok", "device_name": _results.device_name("cpu"),
           "torch": versions["torch"], "date": _results.now(), "commit": _results.commit_label()}
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_worker, args=(spec, _free_port(), out_dir), nprocs=spec.world, start_method="spawn")
        except Exception as exc:  # noqa: BLE001 - a row that cannot run says why
            row["status"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:160]}"
            return row
        ranks = []
        for r in range(spec.world):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    top = max(ranks, key=lambda r: r["peak"])
    row.update(rank_peak_mib=round(top["peak"] / MiB, 2),
               rank_peaks_mib=" ".join(f"{r['peak'] / MiB:.1f}" for r in ranks),
               weights_mib=round(top["weights"] / MiB, 2), gradients_mib=round(top["gradients"] / MiB, 2),
               optimizer_mib=round(top["optimizer_state"] / MiB, 2), saved_mib=round(top["saved"] / MiB, 2),
               transient_mib=round(top["transient"] / MiB, 2), peak_phase=top["phase"],
               step_s=round(max(r["step_s"] for r in ranks), 3), threads=top["threads"])
    return row


def predicted_mib(row: dict, quick: bool = False) -> float:
    """`slimfit plan --world-size` of the row (rank 0, this process; memory/plan/sharding.py: gloo's reduce-scatter
    copy included)."""
    from slimfit.memory.plan.predict import predict
    from slimfit.memory.plan.spec import StepSpec

    spec = StepSpec(row["model"], batch=int(row["batch_per_rank"]), seq=int(row["seq"]), world_size=int(row["world"]),
                    layers=2 if quick else None, **PREDICTED[row["method"]])
    return round(predict(spec).memory.total / MiB, 2)


def markdown(rows: list[dict]) -> str:
    devices = ", ".join(sorted({f"{r['device_name']}, torch {r['torch']}" for r in rows}))
    lines = ["# The whole step's peak per rank under FSDP2 (CPU, gloo)", "", f"Measured on: {devices}.", "",
             f"`{_results.command('sharded', [])}` (rows resumable; `--predict` fills in predictions). "
             "The largest rank's peak (every rank's beside it) and its "
             "parts at the peak; `less than fsdp2`: plain FSDP2's peak at the same world size over the row's; step "
             "time: the slowest rank's median of two steps, the cores shared by the N processes (compare rows of "
             "one world size only). `predicted`: `slimfit plan --world-size N` of rank 0 (the CPU step, gloo's "
             "copy of each reduce-scatter input included), and its error against the measured rank. Each row is the "
             "last measured of its world size and method.", ""]
    latest = {(r["case"], r["world"], r["method"]): r for r in rows}   # a row measured again replaces the last
    rows = list(latest.values())
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]
        first = mine[0]
        lines += [f"## {first['model']}, batch {first['batch_per_rank']} per rank, seq {first['seq']}", ""]
        body = []
        for r in mine:
            if r["status"] != "ok":
                body.append([r["world"], r["method"], r["status"]] + [""] * 10)
                continue
            plain = next((p for p in mine if p["world"] == r["world"] and p["method"] == "fsdp2"
                          and p["status"] == "ok"), None)
            less = f"{float(plain['rank_peak_mib']) / float(r['rank_peak_mib']):.2f}x" if plain else ""
            t = f"{float(r['step_s']) / float(plain['step_s']):.2f}x" if plain else ""
            pred = r.get("predicted_mib") or ""
            pred = f"{float(pred):,.1f} ({float(pred) / float(r['rank_peak_mib']) - 1:+.1%})" if pred else ""
            body.append([r["world"], r["method"], f"{float(r['rank_peak_mib']):,.1f}", less, pred, r["rank_peaks_mib"],
                         r["weights_mib"], r["gradients_mib"], r["optimizer_mib"], r["saved_mib"],
                         r["transient_mib"], r["peak_phase"], t])
        lines += _results.md_table(["N", "method", "rank peak MiB", "less than fsdp2", "predicted", "every rank",
                                    "weights", "gradients", "optimizer", "saved", "transient", "peak in",
                                    "step time vs fsdp2"], body, right=range(2, 13))
        lines.append("")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(DEFAULT_CASES))
    p.add_argument("--world-sizes", default="1,2,4")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--force", action="store_true")
    p.add_argument("--render-only", action="store_true")
    p.add_argument("--predict", action="store_true", help="fill in predicted_mib of the rows that have none")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    csv_path, md_path = _results.results_path("sharded", "csv", "cpu"), _results.results_path("sharded", "md", "cpu")
    rows = _results.read_rows(csv_path) if os.path.exists(csv_path) else []
    if not args.render_only:
        shapes = QUICK_CASES if args.quick else CASES
        worlds = [1, 2] if args.quick else [int(w) for w in args.world_sizes.split(",")]
        for case in args.cases.split(","):
            arch, batch, seq = shapes[case]
            for world in worlds:
                for method in args.methods.split(","):
                    if method not in METHODS:
                        raise SystemExit(f"unknown method {method!r}; one of {METHODS}")
                    done = [r for r in rows if _results.matches(r, case=case, world=str(world), method=method)]
                    if done and not args.force and not args.quick:
                        continue
                    row = measure_row(Spec(case, arch, batch, seq, world, method, args.quick))
                    if row["status"] == "ok" and world > 1:   # (N = 1: FSDP2 over one rank; the plan's 1 is none)
                        row["predicted_mib"] = predicted_mib(row, quick=args.quick)
                    print(f"{case} N={world} {method}: {row.get('rank_peak_mib', row['status'])} MiB "
                          f"(predicted {row.get('predicted_mib', '')}; {row.get('rank_peaks_mib', '')}), "
                          f"{row.get('step_s', '')} s", flush=True)
                    if args.quick:
                        continue
                    _results.append_row(csv_path, row, FIELDS)
                    rows = _results.read_rows(csv_path)
    if args.predict:
        for row in rows:
            if row["status"] == "ok" and not row.get("predicted_mib") and int(row["world"]) > 1:
                row["predicted_mib"] = predicted_mib(row)
                print(f"{row['case']} N={row['world']} {row['method']}: predicted {row['predicted_mib']} MiB, "
                      f"measured {row['rank_peak_mib']}", flush=True)
        _results.write_rows(csv_path, rows, FIELDS)
    if not args.quick and rows:
        _results.write_text(md_path, markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
