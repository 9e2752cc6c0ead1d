#!/usr/bin/env python
"""`slimfit plan --device cuda` against the step peaks measured on a GPU: no GPU needed to run it.

    python -m bench.plan_gpu      # reads bench/results/e2e_gpu.csv and frontier_gpu.csv, writes plan_gpu.{csv,md}

Every measured row of those files (torch.cuda.max_memory_allocated over one whole step after warm-up steps)
is predicted again here on fake CUDA tensors with the StepSpec of the same step: model, batch, shape, dtype,
preset, the scheduler's freeze rate (e2e: 0.9, frontier: ILSScheduler's default 0.7; none with LoRA), LoRA
r=8, checkpointing, the frozen layers' state (frontier +q8: 8-bit, +offload: host). The prediction's known
gaps on a GPU (the CUDA SDPA backends, cuBLAS workspaces, the allocator's rounding; docs/plan.md, "Limits")
show up here as the error.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/plan_gpu.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import statistics
import sys

from bench import _results

FIELDS = ["source", "model", "dtype", "batch", "method", "measured_mib", "predicted_mib", "error_pct", "same_step"]
# e2e's LoRA has lora_dropout=0.1 on query/value only; the plan's LoRA (StepSpec.lora) has no dropout and the
# family's targets: another step, shown but not counted in the error statistics
OTHER_STEP = "e2e LoRA: lora_dropout 0.1, which StepSpec cannot express"
E2E_MODELS = {"BERT-base": ("bert-base", 128), "ViT-B/16": ("vit-base", None)}
FRONTIER_CASES = {"smollm2-2048": ("smollm2-135m", 2048), "bert-16": ("bert-base", 128),
                  "bert-64": ("bert-base", 128)}
FROZEN_STATES = {"q8": "compress", "offload": "offload"}   # frontier's method suffixes


def _method_spec(method: str, rate: float) -> dict | None:
    """StepSpec fields of a bench method (None: a method the plan does not model)."""
    preset, _, extra = method.removeprefix("slimfit-").partition("+")
    if not method.startswith("slimfit-"):
        known = {"sdpa": {}, "grad-ckpt": {"checkpointing": True}, "lora-r8": {"lora": 8},
                 "lora-r8+ckpt": {"lora": 8, "checkpointing": True}}
        return known.get(method)
    if preset not in ("exact", "paper", "aggressive") or extra not in ("", "lora", "lora+ckpt", *FROZEN_STATES):
        return None
    fields = {"preset": preset, "frozen_state": None}   # slimfit-<preset>: the state in full
    if extra in FROZEN_STATES:
        fields.update(rate=rate, frozen_state=FROZEN_STATES[extra])
    elif extra:
        fields.update(lora=8, checkpointing=extra.endswith("ckpt"))
    else:
        fields["rate"] = rate
    return fields



def _planned_dtype(measured: str) -> str:
    """The StepSpec dtype of a measured GPU row: its "bf16" rows ran fp32 weights under bf16 autocast."""
    return "bf16-autocast" if measured == "bf16" else measured

def _cases() -> list[tuple[str, dict, dict]]:
    """(source, the measured row's columns, StepSpec keyword arguments) of every GPU row the plan models."""
    out = []
    for row in _results.read_rows(_results.results_path("e2e", "csv", "cuda")):
        arch, seq = E2E_MODELS.get(row["model"].split(",")[0], (None, None))
        fields = _method_spec(row["method"], 0.9)
        if arch and fields is not None and row.get("peak_mib"):
            spec = dict(model=arch, batch=int(row["batch"]), seq=seq, dtype=_planned_dtype(row["dtype"]), **fields)
            out.append(("e2e", {"model": row["model"], "measured": float(row["peak_mib"]), **row}, spec))
    for row in _results.read_rows(_results.results_path("frontier", "csv", "cuda")):
        arch, seq = FRONTIER_CASES.get(row["case"], (None, None))
        fields = _method_spec(row["method"], 0.7)
        if arch and fields is not None and row.get("step_peak_mib"):
            spec = dict(model=arch, batch=int(row["batch"]), seq=seq, dtype=_planned_dtype(row["dtype"]), **fields)
            out.append(("frontier", {"measured": float(row["step_peak_mib"]), **row}, spec))
    return out


def _predict(spec: dict) -> float:
    from slimfit.memory.plan.predict import predict
    from slimfit.memory.plan.spec import StepSpec

    return predict(StepSpec(device="cuda", **spec)).total / 2**20


def markdown(rows: list[dict]) -> str:
    errors = sorted(abs(float(r["error_pct"])) for r in rows if r["same_step"] == "yes")
    p90 = errors[min(len(errors) - 1, int(0.9 * len(errors)))] if errors else float("nan")
    lines = ["# `slimfit plan --device cuda` against GPU step peaks", "",
             f"`{_results.command('plan_gpu', [])}`: {len(rows)} rows of e2e_gpu.csv and frontier_gpu.csv (NVIDIA "
             f"H200, torch.cuda.max_memory_allocated), predicted on this machine without a GPU. Over the "
             f"{len(errors)} rows whose step the plan describes: |error| median {statistics.median(errors):.1f}%, "
             f"p90 {p90:.1f}%, max {errors[-1]:.1f}% (error = predicted / measured - 1). The other rows: "
             f"{OTHER_STEP}.", ""]
    body = [[r["model"], r["dtype"], r["batch"], r["method"], f"{float(r['measured_mib']):,.0f}",
             f"{float(r['predicted_mib']):,.0f}", f"{float(r['error_pct']):+.1f}%",
             "yes" if r["same_step"] == "yes" else "no: e2e LoRA dropout"] for r in rows]
    lines += _results.md_table(["model", "dtype", "batch", "method", "measured MiB", "predicted MiB", "error",
                                "the plan's step"], body, right=range(2, 7))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    rows = []
    for source, measured, spec in _cases():
        predicted = _predict(spec)
        rows.append({"source": source, "model": measured.get("model") or measured["case"], "dtype": spec["dtype"],
                     "batch": spec["batch"], "method": measured["method"],
                     "measured_mib": f"{measured['measured']:.1f}",
                     "predicted_mib": f"{predicted:.1f}",
                     "error_pct": f"{100 * (predicted / measured['measured'] - 1):.2f}",
                     "same_step": "no" if source == "e2e" and "lora" in measured["method"] else "yes"})
        print(f"{rows[-1]['model']:28s} {spec['dtype']:5s} {measured['method']:26s} "
              f"{measured['measured']:9.0f} {predicted:9.0f} {rows[-1]['error_pct']:>7}%", flush=True)
    _results.write_rows(_results.results_path("plan_gpu", "csv"), rows, FIELDS)
    text = markdown(rows)
    _results.write_text(_results.results_path("plan_gpu", "md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
