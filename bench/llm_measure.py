#!/usr/bin/env python
"""The LLM-scale plan checked where it can be: real-width decoders in bf16 weights, every layer, one whole step
measured on the CPU against `slimfit plan`'s prediction of the same step.

    python -m bench.llm_measure                    # every row, appended to bench/results/llm_measure_cpu.csv as
                                                   # it lands (rows already there are skipped); then the table
    python -m bench.llm_measure --only qwen        # the models whose name contains this
    python -m bench.llm_measure --only qwen --rows slimfit --again   # those rows measured again, each replaced
    python -m bench.llm_measure --quick --out-dir /tmp/x   # a tiny decoder (the smoke test)

Each row is one StepSpec (slimfit/memory/plan/) at batch 1, seq 1024, bf16 weights (AdamW's moments in bf16, as
torch makes them), predicted on fake tensors and then run for real: the step the plan predicts (the first,
AdamW's state made beforehand, the scheduler's first frozen set) measured (slimfit.memory.measure_step: every
storage, sampled after every op), one untracked step timed, and a third step measured again (`later`: the
scheduler's frozen set chosen by its scores, the held state re-encoded by real steps). error = (predicted -
measured) / measured; the target is 5%. Time is one step's wall time on one thread, relative to the plain row
of the same model in the same run (noisy: for the ratio, not the seconds). Rows:
  plain             torch AdamW, sdpa attention;
  torchtune recipe  checkpointing + the optimizer step in backward + chunked CE, with torch's AdamW: torchao's
                    AdamW8bit compiles its step with fullgraph=True, which refuses to run under the tracker's
                    dispatch mode (and its state is a tensor subclass the tracker cannot see into), so the 8-bit
                    state of the recipe is predicted only (bench/llm_plan.py);
  LoRA r8 + ckpt    peft's default targets at rank 8, checkpointing;
  slimfit defaults  paper() + ILSScheduler at rate 0.7 (every AdamW state 8-bit), the frozen set at the rate;
  slimfit + ckpt + step in backward, every state 8-bit;
  slimfit defaults with every held moment 4-bit (ILSScheduler(state_code="dynamic4"));
  slimfit + ckpt + step in backward, every held moment 4-bit (the smallest full fine-tuning slimfit offers).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/llm_measure.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import sys
import time

from bench import _results

NAME = "llm_measure"
MiB = 2 ** 20
FIELDS = ["model", "batch", "seq", "row", "predicted_mib", "measured_mib", "error_pct", "step_s", "later_mib",
          "predicted_phase", "measured_phase", "device_name", "torch", "commit", "date"]
CASES = [("qwen2.5-0.5b", 1, 1024), ("llama-3.2-1b", 1, 1024)]
QUICK = [("llama-tiny", 1, 32)]
ROWS = {"plain bf16, AdamW": {},
        "torchtune's recipe with torch's AdamW: ckpt + step in backward + chunked CE":
            dict(checkpointing=True, step_in_backward=True, chunked_loss=True),
        "LoRA r8 + checkpointing": dict(lora=8, checkpointing=True),
        "slimfit defaults: paper(), rate 0.7": dict(preset="paper", rate=0.7),
        "slimfit + ckpt + step in backward, every state 8-bit":
            dict(preset="paper", rate=0.7, checkpointing=True, step_in_backward=True, optimizer_state="8bit"),
        "slimfit defaults, every moment 4-bit (state_code='dynamic4')":
            dict(preset="paper", rate=0.7, state_code="dynamic4"),
        "slimfit + ckpt + step in backward, every moment 4-bit":
            dict(preset="paper", rate=0.7, checkpointing=True, step_in_backward=True, optimizer_state="8bit",
                 state_code="dynamic4")}


def measure_row(model: str, batch: int, seq: int, fields: dict) -> dict:
    """One row: the prediction, then the step run for real (warm-up, one timed step, the measured one)."""
    from slimfit.memory import peak
    from slimfit.memory.plan.step import run_step
    from slimfit.plan import StepSpec, open_step, predict

    spec = StepSpec(model, batch=batch, seq=seq, dtype="bf16", **{"rate": 0.0, **fields})
    predicted = predict(spec)
    with open_step(spec) as step:
        measured = peak.measure_step(step.model, step.forward, step.optimizer, after_step=step.after_step,
                                     name=spec.label())
        start = time.perf_counter()
        run_step(step)
        seconds = time.perf_counter() - start
        later = peak.measure_step(step.model, step.forward, step.optimizer, after_step=step.after_step,
                                  name=spec.label())
    error = 100.0 * (predicted.total - measured.total) / measured.total
    return {"model": model, "batch": batch, "seq": seq, "predicted_mib": f"{predicted.total / MiB:.1f}",
            "measured_mib": f"{measured.total / MiB:.1f}", "error_pct": f"{error:+.2f}", "step_s": f"{seconds:.2f}",
            "later_mib": f"{later.total / MiB:.1f}",
            "predicted_phase": predicted.memory.peak_phase, "measured_phase": measured.peak_phase,
            "device_name": _results.device_name("cpu"), "torch": _results.versions()["torch"],
            "commit": _results.commit_label(), "date": _results.now()}


def markdown(rows: list[dict], argv: list[str]) -> str:
    """The results file: what was run, the table (time relative to the model's plain row), the error's range."""
    plain = {r["model"]: r for r in rows if r["row"] == "plain bf16, AdamW"}

    def time_ratio(r: dict) -> str:
        base = plain.get(r["model"])
        if base is None:
            return "-"
        ratio = f"{float(r['step_s']) / float(base['step_s']):.2f}x"
        # another run (another commit or day) is another machine load: a lead, not a measurement
        return ratio if (r["commit"], r["date"][:10]) == (base["commit"], base["date"][:10]) else ratio + "*"

    head = ["model", "b", "seq", "configuration", "predicted MiB", "measured MiB", "error", "a later step MiB",
            "step time vs plain", "peak in (predicted / measured)"]
    body = [[r["model"], r["batch"], r["seq"], r["row"], r["predicted_mib"], r["measured_mib"], f"{r['error_pct']}%",
             r["later_mib"], time_ratio(r),
             f"{r['predicted_phase']} / {r['measured_phase']}"] for r in rows]
    errors = [abs(float(r["error_pct"])) for r in rows]
    lines = ["# slimfit plan against the measured step: real-width decoders, bf16 weights (CPU)", "",
             f"`{_results.command(NAME, argv)}`; {rows[0]['device_name'] if rows else ''}, torch "
             f"{rows[0]['torch'] if rows else ''}; commits and dates per row in llm_measure_cpu.csv.", "",
             "One whole step (forward, backward, optimizer step, zero_grad, the scheduler's step) of every layer, "
             "random weights; bench/llm_measure.py's docstring says what each row is. Step time: one step on one "
             "thread after a warm-up, relative to the model's plain row; * marks a row measured in another run than "
             "that plain row (another commit or day, so another machine load): a lead, not a measurement.", ""]
    lines += _results.md_table(head, body, right={4, 5, 6, 7, 8})
    if errors:
        lines += ["", f"Largest |error|: {max(errors):.2f}% over {len(errors)} rows (target 5%)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny decoder only (the smoke test)")
    p.add_argument("--only", default=None, help="models whose name contains this")
    p.add_argument("--out-dir", default=None, help="where the results go (default bench/results)")
    p.add_argument("--rows", default=None, help="rows whose configuration contains this")
    p.add_argument("--again", action="store_true", help="measure rows already there again (each replaced in place)")
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    write = not (args.quick and args.out_dir is None)   # the smoke test writes nothing unless told where
    csv_path = _results.results_path(NAME, "csv", device="cpu", out_dir=args.out_dir)
    done = _results.read_rows(csv_path) if write else []
    have = {(r["model"], r["row"]) for r in done}
    for model, batch, seq in [c for c in (QUICK if args.quick else CASES) if args.only is None or args.only in c[0]]:
        for label, fields in ROWS.items():
            if (args.rows is not None and args.rows not in label) or ((model, label) in have and not args.again):
                continue
            row = {**measure_row(model, batch, seq, fields), "row": label}
            done = [r for r in done if (r["model"], r["row"]) != (model, label)] + [row]
            if write:
                _results.write_rows(csv_path, done, FIELDS)
            print(f"{model:14s} {label:60s} predicted {row['predicted_mib']:>9} MiB, measured "
                  f"{row['measured_mib']:>9} MiB ({row['error_pct']}%), {row['step_s']} s", flush=True)
    if write:
        _results.write_text(_results.results_path(NAME, "md", device="cpu", out_dir=args.out_dir),
                            markdown(done, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
