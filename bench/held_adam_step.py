#!/usr/bin/env python
"""The AdamW step alone, over a model's parameters: torch's (fp32 moments) against slimfit's held step (every
moment 8-bit between steps), fused (one slimfit::adam_blockwise_ op per call) and unfused (decode, torch's
Adam, encode).

    python -m bench.held_adam_step                 # bert-base and the SmolLM2-135M shape, fp32 and bf16 weights
    python -m bench.held_adam_step --quick         # bert-tiny, llama-tiny: a smoke check, writes nothing
    python -m bench.held_adam_step --device cuda --models bert-base,smollm2-135m,qwen2.5-0.5b   # held_adam_step_gpu.*

Per row: the median time of one optimizer step (after WARMUP steps, over REPS, random gradients fixed for the
run; 1 thread unless --threads), the optimizer state's bytes, and the ops one step dispatches (a
TorchDispatchMode, views left out: about one kernel launch each on a GPU; foreach ops count once). Rows:
  torch foreach    torch.optim.AdamW(foreach=True): what torch picks on CUDA
  torch fused      torch.optim.AdamW(fused=True): one kernel per parameter group (fp32 moments)
  held fused       slimfit's ChunkedStep + FrozenState(between_steps=True): the default's 8-bit dynamic moments,
                   stepped by slimfit::adam_blockwise_ (bf16 weights rounded stochastically, as the default)
  held unfused     the same held state through the decode / torch's Adam / encode round (held_step.FUSED off)
  held fused 4-bit the held step with every moment 4-bit (state_code="dynamic4"), through the same op
Time ratios are to torch foreach of the same model and dtype, measured in the same run. On CUDA a step is timed
between two synchronizations, and the ops are the launches the host makes (the Triton op: one per weight and
gradient dtype of a call).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:
    import _shim
    _shim.run_as_module(__file__)

import argparse
import collections
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench import _results

NAME = "held_adam_step"
MODELS = ("bert-base", "smollm2-135m")
QUICK_MODELS = ("bert-tiny", "llama-tiny")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROWS = ("torch foreach", "torch fused", "held fused", "held unfused", "held fused 4-bit")
WARMUP, REPS = 2, 5
FIELDS = ["model", "dtype", "row", "params", "state_mib", "step_ms", "vs_foreach", "ops", "threads", "device_name",
          "torch", "commit", "date"]
_NO_LAUNCH = ("aten.slice", "aten.view", "aten.detach", "aten.alias", "aten.as_strided", "aten.t", "aten.expand",
              "aten.transpose", "prim.", "profiler.")


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if not name.startswith(_NO_LAUNCH):
            self.names[name] += 1
        return func(*args, **(kwargs or {}))


def _params(model_name: str, dtype: torch.dtype, device: str = "cpu") -> list[torch.nn.Parameter]:
    """The model's parameters (random weights) as leaf tensors of ``dtype`` on ``device``, each with a fixed random
    gradient."""
    from slimfit import architectures as archs

    model = archs.build(archs.resolve(model_name), seed=0)
    g = torch.Generator().manual_seed(0)
    params = []
    for p in model.parameters():
        q = torch.nn.Parameter(p.detach().to(device, dtype).clone())
        q.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(device, dtype)
        params.append(q)
    return params


def _optimizer(row: str, params):
    from slimfit.optim import ChunkedStep, FrozenState

    if row == "torch foreach":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True), ()
    if row == "torch fused":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True), ()
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    rounding = "stochastic" if params[0].dtype != torch.float32 else "nearest"
    keep = (ChunkedStep(opt, weight_rounding=rounding, seed=0),
            FrozenState(opt, "compress", between_steps=True, seed=0, code="dynamic", bits=4 if "4-bit" in row else 8,
                        stochastic=True))
    return opt, keep


def _state_bytes(opt) -> int:
    seen, total = set(), 0
    for st in opt.state.values():
        for v in st.values():
            for t in (v.values() if isinstance(v, dict) else [v]):
                if isinstance(t, torch.Tensor) and t.data_ptr() not in seen and t.dim() > 0:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
    return total


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(model_name: str, dtype_name: str, row: str, device: str = "cpu") -> dict:
    from slimfit.optim import held_step

    params = _params(model_name, DTYPES[dtype_name], device)
    grads = [p.grad for p in params]
    opt, keep = _optimizer(row, params)
    held_step.FUSED = row != "held unfused"
    try:
        times = []
        for i in range(WARMUP + REPS):
            for p, g in zip(params, grads):
                p.grad = g
            _sync(device)
            start = time.perf_counter()
            if i == WARMUP:
                with _Ops() as ops:
                    opt.step()
            else:
                opt.step()
            _sync(device)
            times.append(time.perf_counter() - start)
    finally:
        held_step.FUSED = True
    del keep
    return {"model": model_name, "dtype": dtype_name, "row": row, "params": sum(p.numel() for p in params),
            "state_mib": f"{_state_bytes(opt) / 2**20:.1f}",
            "step_ms": f"{1e3 * statistics.median(times[WARMUP:]):.1f}",
            "ops": sum(ops.names.values()), "threads": torch.get_num_threads(),
            "device_name": _results.device_name(device), "torch": _results.versions()["torch"],
            "commit": _results.commit_label(), "date": _results.now()}


def markdown(rows: list[dict], argv) -> str:
    base = {(r["model"], r["dtype"]): float(r["step_ms"]) for r in rows if r["row"] == "torch foreach"}
    lines = [f"# The AdamW step alone: torch's against slimfit's held 8-bit step ({NAME}.py)", "",
             f"Command: `{_results.command(NAME, argv)}`", "",
             f"{rows[0]['device_name']}, torch {rows[0]['torch']}, {rows[0]['threads']} thread(s), commit "
             f"{rows[0]['commit']}, {rows[0]['date']}. Median of {REPS} steps after {WARMUP}; ops of one step (views "
             "left out; a foreach op counts once). Ratios to torch foreach of the same model and dtype, this run.", ""]
    body = []
    for r in rows:
        ms = float(r["step_ms"])
        ratio = ms / base[(r["model"], r["dtype"])] if (r["model"], r["dtype"]) in base else None
        body.append([r["model"], r["dtype"], r["row"], f"{int(r['params']):,}", r["state_mib"], r["step_ms"],
                     f"{ratio:.2f}x" if ratio else "-", f"{int(r['ops']):,}"])
    lines += _results.md_table(["model", "weights", "row", "params", "state MiB", "step ms", "vs torch foreach",
                                "ops"], body, right=(3, 4, 5, 6, 7))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the small test architectures; writes nothing unless --out")
    p.add_argument("--out", default=None, help="output folder (default bench/results)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--models", default=None, help="comma-separated slimfit.architectures names (default: MODELS)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    models = args.models.split(",") if args.models else (QUICK_MODELS if args.quick else MODELS)
    for model in models:
        for dtype in DTYPES:
            for row in ROWS:
                r = measure(model, dtype, row, args.device)
                print(f"{model:14s} {dtype} {row:14s} {r['step_ms']:>9s} ms  state {r['state_mib']:>8s} MiB  "
                      f"{r['ops']:>6,} ops", flush=True)
                rows.append(r)
    md = markdown(rows, argv)
    print()
    print(md)
    if args.out is not None or not args.quick:
        where = "gpu" if args.device == "cuda" else "cpu"
        _results.write_rows(_results.results_path(NAME, "csv", where, args.out), rows, FIELDS)
        _results.write_text(_results.results_path(NAME, "md", where, args.out), md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
