#!/usr/bin/env python
"""How close `slimfit plan`'s predicted step peak is to the measured one, over configurations of five models.

    python -m bench.plan_accuracy             # every configuration, appended to bench/results/plan_accuracy_cpu.csv
                                              # as it lands; those already there are skipped (resumable); then the
                                              # Markdown table and the error percentiles
    python -m bench.plan_accuracy --quick     # tiny models, a few configurations, no timing: writes nothing
    python -m bench.plan_accuracy --render-only   # rebuild the Markdown from the CSV
    python -m bench.plan_accuracy --time-check    # the time model (--fit's ranking) against measured step times

For each configuration (slimfit.plan.StepSpec: model, batch, sequence or image size, dtype, preset, freeze rate,
LoRA rank, gradient checkpointing), the same step (slimfit/plan/step.py) is
  predicted  slimfit.plan.predict: the step on fake tensors under slimfit.step_memory's tracker;
  measured   for real through bench/_measure.py: the total step peak (slimfit.step_memory.measure_step, the
             tracker over real storages), then the median time of two untracked steps (bench/_timing.py).
error = (predicted - measured) / measured. Target: |error| within 5% at the 90th percentile (printed, not asserted).
The time columns calibrate slimfit/plan/cost.py's estimate (est. ms), which --fit uses to rank configurations.

Models: BERT-base, ViT-B/16, llama-small (issue 14's decoder), SmolLM2-135M (Llama layout) and a Qwen2.5-0.5B
layout cut to 4 layers (vocabulary 151,936: the LM head dominates), random weights; sizes small enough for a
2-core, 24 GiB machine (BERT-base batch <= 8, seq <= 256; SmolLM2 batch 1, seq <= 512).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/plan_accuracy.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import sys
import time

import torch

from bench import _measure, _results, _timing
from slimfit import architectures as archs
from slimfit.training.finetune import quiet_transformers

NAME = "plan_accuracy"
KEY = ("model", "batch", "seq", "image", "dtype", "preset", "rate", "lora", "ckpt", "attn", "frozen")
FIELDS = KEY + ("status", "measured_bytes", "predicted_bytes", "error_pct", "measured_phase", "predicted_phase",
                "measured_parts", "predicted_parts", "predict_s", "measure_s", "step_ms", "est_ms", "flops",
                "bytes_moved", "ops", "params", "trained", "device_name", "torch", "commit", "date")
TARGET_PCT = 5.0
MiB = 2 ** 20


def qwen_ref(layers: int = 4):
    """Qwen2.5-0.5B's layout (hidden 896, 14/2 heads, FFN 4864, vocabulary 151,936, tied) cut to `layers`."""
    import transformers

    from slimfit.memory.models import ModelRef

    config = transformers.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                      num_hidden_layers=layers, num_attention_heads=14, num_key_value_heads=2,
                                      max_position_embeddings=32768, tie_word_embeddings=True, rms_norm_eps=1e-6)
    return ModelRef(f"qwen2.5-0.5b-{layers}l", archs.CAUSAL_LM, config, "Qwen2ForCausalLM", "config")


# (model, batch, seq or None, image or None, options): 42 configurations
FULL = [
    ("bert-base", 4, 128, None, {}), ("bert-base", 8, 256, None, {}), ("bert-base", 2, 64, None, {}),
    ("bert-base", 8, 256, None, dict(preset="paper", rate=0.7)),
    ("bert-base", 8, 128, None, dict(preset="exact", rate=0.5)),
    ("bert-base", 4, 256, None, dict(preset="aggressive", rate=0.9)),
    ("bert-base", 8, 256, None, dict(checkpointing=True)),
    ("bert-base", 8, 256, None, dict(preset="paper", rate=0.7, checkpointing=True)),
    ("bert-base", 8, 128, None, dict(lora=8)), ("bert-base", 8, 256, None, dict(preset="paper", lora=8)),
    ("bert-base", 8, 256, None, dict(dtype="bf16-autocast")),
    ("bert-base", 4, 128, None, dict(preset="paper", rate=0.7, dtype="bf16-autocast")),
    ("bert-base", 8, 256, None, dict(attn="eager")),
    ("bert-base", 8, 256, None, dict(preset="aggressive", lora=8, checkpointing=True)),
    ("vit-base", 2, None, 224, {}), ("vit-base", 4, None, 224, dict(preset="paper", rate=0.7)),
    ("vit-base", 4, None, 224, dict(preset="exact", checkpointing=True)), ("vit-base", 4, None, 224, dict(lora=8)),
    ("vit-base", 2, None, 160, dict(preset="aggressive", rate=0.9, dtype="bf16-autocast")),
    ("llama-small", 4, 256, None, {}), ("llama-small", 8, 512, None, dict(preset="paper", rate=0.7)),
    ("llama-small", 8, 512, None, dict(preset="aggressive", checkpointing=True)),
    ("llama-small", 4, 1024, None, dict(dtype="bf16-autocast")), ("llama-small", 8, 256, None, dict(lora=8)),
    ("llama-small", 4, 1024, None, dict(preset="exact", rate=0.5)),
    ("llama-small", 8, 512, None, dict(preset="paper", lora=16, dtype="bf16-autocast")),
    ("smollm2-135m", 1, 256, None, {}), ("smollm2-135m", 1, 512, None, dict(preset="paper", rate=0.7)),
    ("smollm2-135m", 1, 512, None, dict(checkpointing=True)), ("smollm2-135m", 1, 512, None, dict(lora=16)),
    ("smollm2-135m", 1, 256, None, dict(preset="aggressive", rate=0.9, dtype="bf16-autocast")),
    ("smollm2-135m", 1, 384, None, dict(preset="exact", rate=0.5)),
    ("qwen", 1, 256, None, {}), ("qwen", 1, 256, None, dict(preset="paper", rate=0.7)),
    ("qwen", 2, 256, None, dict(lora=8, dtype="bf16-autocast")),
    ("qwen", 1, 512, None, dict(preset="aggressive", rate=0.5, checkpointing=True)),
    # the scheduler's default ("auto"): every layer's AdamW state 8-bit under the chunked step
    ("bert-base", 8, 256, None, dict(preset="paper", rate=0.7, frozen_state="auto")),
    ("vit-base", 4, None, 224, dict(preset="paper", rate=0.7, frozen_state="auto")),
    ("llama-small", 8, 512, None, dict(preset="paper", rate=0.7, frozen_state="auto")),
    ("smollm2-135m", 1, 512, None, dict(preset="paper", rate=0.7, frozen_state="auto")),
    # the same held by name (frozen_state="compress_all"), at other shapes and presets
    ("bert-base", 8, 128, None, dict(preset="paper", rate=0.7, frozen_state="compress_all")),
    ("llama-small", 8, 512, None, dict(preset="aggressive", rate=0.7, frozen_state="compress_all")),
]
QUICK = [
    ("bert-tiny", 2, 32, None, {}), ("bert-tiny", 2, 32, None, dict(preset="paper", rate=0.5)),
    ("bert-tiny", 2, 32, None, dict(lora=4, checkpointing=True)),
    ("llama-tiny", 2, 64, None, dict(preset="aggressive", dtype="bf16-autocast")),
]


# ------------------------------------------------------------------ configurations
def spec_of(entry):
    """The StepSpec of a configuration entry (model, batch, seq, image, options)."""
    from slimfit.plan import StepSpec

    model, batch, seq, image, options = entry
    # the rows were measured with the frozen layers' state in full (the scheduler's default then; the key
    # has no frozen_state column): they keep that meaning
    options = {"frozen_state": None, **options}
    return StepSpec(qwen_ref() if model == "qwen" else model, batch=batch, seq=seq, image_size=image, **options)


def key_of(spec) -> dict:
    """The CSV key fields of a spec (strings, as the CSV holds them)."""
    values = dict(model=spec.model_name, batch=spec.batch, seq=spec.seq or "", image=spec.image_size or "",
                  dtype=spec.dtype, preset=spec.preset, rate=f"{spec.rate:g}", lora=spec.lora or 0,
                  ckpt=int(spec.checkpointing), attn=spec.attn, frozen=spec.held_state or "")
    return {k: str(v) for k, v in values.items()}


def _parts(parts: dict) -> str:
    """The parts of a peak in MiB, 'W + G + AdamW + saved + transient', for one table cell."""
    return " + ".join(f"{parts[p] / MiB:.1f}" for p in ("weights", "gradients", "optimizer_state", "saved",
                                                          "transient"))


def _setup_case(spec, time_it: bool):
    """A bench/_measure.py Case that opens the spec's step (slimfit/plan/step.py) as a Setup."""
    import contextlib

    from slimfit.plan import open_step

    @contextlib.contextmanager
    def opened():
        """The spec's step (open_step) as a bench/_measure.py Setup, undone on exit."""
        with open_step(spec) as step:
            yield _measure.Setup(step.model, step.inputs, dtype=step.spec.dtype, optimizer=step.optimizer,
                                 after_step=step.after_step, seed=spec.seed)

    return _measure.Case(spec.label(), opened)


def _what(time_it: bool) -> _measure.What:
    """What bench/_measure.py measures of a row: the step peak, and the time of two steps unless told not to."""
    timing = _timing.Settings(cpu_warmup=0, cpu_min_reps=2, cpu_min_time_s=0.0, cpu_max_reps=2,
                              cpu_slow_min_reps=2) if time_it else None
    return _measure.What(saved=False, peak=True, time=timing)


def measure_row(spec, time_it: bool = True) -> dict:
    """Predict, then measure, one configuration: a CSV row."""
    from slimfit.plan import predict

    row = dict(key_of(spec), status="ok", device_name=_results.device_name("cpu"),
               torch=_results.versions()["torch"], commit=_results.commit_label(), date=_results.now())
    start = time.perf_counter()
    p = predict(spec)
    row.update(predict_s=f"{time.perf_counter() - start:.1f}", predicted_bytes=p.total, predicted_phase=p.peak_phase,
               predicted_parts=_parts(p.parts()), est_ms=f"{p.step_time('cpu') * 1e3:.0f}", flops=f"{p.flops:.4g}",
               bytes_moved=f"{p.bytes_moved:.4g}", ops=p.ops, params=p.params, trained=p.trained)
    start = time.perf_counter()
    (_, result), = _measure.run([_setup_case(spec, time_it)], _what(time_it))
    m = result.peak
    row.update(measure_s=f"{time.perf_counter() - start:.1f}", measured_bytes=m.total, measured_phase=m.peak_phase,
               measured_parts=_parts(m.parts()), error_pct=f"{100.0 * (p.total - m.total) / m.total:+.3f}",
               step_ms=f"{result.timing.ms:.0f}" if result.timing is not None else "")
    return row


# ------------------------------------------------------------------ summary and tables
def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between the sorted values."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary(rows: list[dict]) -> dict:
    """p50 / p90 / max of |error| in percent over the rows measured ok, and how many."""
    errors = [abs(float(r["error_pct"])) for r in rows if r.get("status") == "ok" and r.get("error_pct")]
    if not errors:
        return {"n": 0}
    return {"n": len(errors), "p50": percentile(errors, 50), "p90": percentile(errors, 90), "max": max(errors)}


def summary_line(s: dict) -> str:
    """The percentiles as the one line the output and the Markdown print, with the target met or not."""
    if not s["n"]:
        return "no configuration measured"
    met = "met" if s["p90"] <= TARGET_PCT else "NOT met"
    return (f"|error| over {s['n']} configurations: p50 {s['p50']:.3f}%, p90 {s['p90']:.3f}%, max {s['max']:.3f}% "
            f"(target: p90 within {TARGET_PCT:g}%: {met})")


def _config(r: dict) -> str:
    """A row's choices as text (preset, rate, LoRA, checkpointing, dtype, attention)."""
    parts = [r["preset"] if r["preset"] != "none" else "plain"]
    parts += [f"rate {r['rate']}"] if r["rate"] not in ("0", "") else []
    parts += [f"LoRA r{r['lora']}"] if r["lora"] not in ("0", "") else []
    parts += ["ckpt"] if r["ckpt"] == "1" else []
    parts += [r["dtype"]] if r["dtype"] != "fp32" else []
    parts += [r["attn"]] if r["attn"] != "sdpa" else []
    parts += [f"frozen state {'8-bit' if r['frozen'] == 'compress' else r['frozen']}"] if r.get("frozen") else []
    return ", ".join(parts)


def table(rows: list[dict], markdown: bool) -> list[str]:
    """The rows as a Markdown or terminal table."""
    head = ["model", "shape", "configuration", "measured MiB", "predicted MiB", "error %", "predicted - measured B",
            "peak in (meas / pred)", "parts at the peak, measured: W + G + AdamW + saved + transient MiB", "predict s"]
    body = []
    for r in rows:
        shape = f"b{r['batch']} " + (f"s{r['seq']}" if r["seq"] else f"{r['image']}px")
        if r.get("status") != "ok":
            body.append([r["model"], shape, _config(r), "-", "-", "-", "-", r.get("status", ""), "", ""])
            continue
        measured, predicted = int(r["measured_bytes"]), int(r["predicted_bytes"])
        body.append([r["model"], shape, _config(r), f"{measured / MiB:,.1f}", f"{predicted / MiB:,.1f}",
                     r["error_pct"], f"{predicted - measured:+,}", f"{r['measured_phase']} / {r['predicted_phase']}",
                     r["measured_parts"], r["predict_s"]])
    fmt = _results.md_table if markdown else _results.text_table
    return fmt(head, body, right={3, 4, 5, 6, 9})


def markdown(rows: list[dict], argv) -> str:
    """The results file: header (machine, versions, command), how the columns were made, summary, table.
    The command is the one that makes the rows (--render-only left out)."""
    argv = [a for a in argv if a != "--render-only"]
    lines = [f"# slimfit plan: predicted vs measured step peak ({_results.device_name('cpu')})", "",
             f"torch {_results.versions()['torch']}, {_results.now()}, commit {_results.commit_label()}; "
             f"`{_results.command(NAME, argv)}`.", "",
             "Predicted: `slimfit.plan.predict` (the step on fake tensors under slimfit.step_memory's tracker). "
             "Measured: the same step (slimfit/plan/step.py) run for real, its total peak from "
             "slimfit.step_memory.measure_step (forward, backward, AdamW step, zero_grad, the scheduler's step; "
             "AdamW state made beforehand). error = (predicted - measured) / measured; predict s: the prediction's "
             "own time on this busy 2-core machine. Step times (the CSV's step_ms, est_ms) are not compared here: "
             "`--time-check` checks the time model.",
             "", summary_line(summary(rows)), ""]
    return "\n".join(lines + table(rows, markdown=True)) + "\n"


# ------------------------------------------------------------------ the time model's check (--time-check)
TIME_FIT = [("bert-base", dict(batch=4, seq=128, layers=4), c) for c in (
    {}, dict(rate=0.9), dict(preset="paper"), dict(preset="paper", rate=0.7), dict(lora=8), dict(checkpointing=True),
    dict(preset="aggressive", lora=8), dict(preset="exact", rate=0.5),
    dict(preset="paper", rate=0.7, checkpointing=True), dict(dtype="bf16-autocast"))]
HELD_OUT = (dict(), dict(rate=0.9), dict(preset="paper", rate=0.7), dict(lora=8), dict(checkpointing=True),
            dict(preset="aggressive"), dict(dtype="bf16-autocast"))
TIME_HELD_OUT = [(m, base, c) for m, base in (("llama-small", dict(batch=4, seq=512)),
                                              ("vit-base", dict(batch=2, image_size=224, layers=4)))
                 for c in HELD_OUT]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two lists without ties."""
    def ranks(v):
        """{index: rank} of the values, smallest first."""
        order = sorted(range(len(v)), key=v.__getitem__)
        return {i: k for k, i in enumerate(order)}
    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1.0 - 6.0 * sum((ra[i] - rb[i]) ** 2 for i in range(n)) / (n * (n * n - 1))


def time_check(entries) -> list[list]:
    """One thread's CPU time of each configuration's step (median of 3 after one, time.process_time: a busy
    shared machine does not inflate it) beside slimfit/plan/cost.py's estimate; rank correlation per model."""
    from slimfit.memory.plan.step import run_step
    from slimfit.plan import StepSpec, open_step, predict

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    body = []
    try:
        for model, base, options in entries:
            spec = StepSpec(model, **base, **options)
            estimate = predict(spec).step_time("cpu")
            with open_step(spec) as step:
                run_step(step)
                times = []
                for _ in range(3):
                    start = time.process_time()
                    run_step(step)
                    times.append(time.process_time() - start)
            body.append([model, spec.shape(), spec.label(), sorted(times)[1], estimate])
    finally:
        torch.set_num_threads(threads)
    return body


def print_time_check() -> None:
    """The check of the time model: the configurations it was fitted to, then two held-out models."""
    for title, entries in (("fitted to", TIME_FIT), ("held out", TIME_HELD_OUT)):
        body = time_check(entries)
        rows = [[m, shape, label, f"{t:.3f}", f"{e:.3f}", f"{100 * (e - t) / t:+.0f}"]
                for m, shape, label, t, e in body]
        print(f"\n{title}:")
        print("\n".join(_results.text_table(["model", "shape", "configuration", "CPU s (1 thread)", "est. s",
                                              "diff %"], rows, right={3, 4, 5})))
        for model in dict.fromkeys(r[0] for r in body):
            mine = [r for r in body if r[0] == model]
            print(f"{model}: rank correlation (Spearman) {spearman([r[3] for r in mine], [r[4] for r in mine]):.2f}")


# ------------------------------------------------------------------ the run
def _parser() -> argparse.ArgumentParser:
    """The script's arguments."""
    parser = argparse.ArgumentParser(prog="python -m bench.plan_accuracy", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, a few configurations, no timing; "
                        "writes nothing unless --out-dir is given")
    parser.add_argument("--only", default="", help="only configurations whose model name contains this")
    parser.add_argument("--no-time", action="store_true", help="skip the step timing (memory only)")
    parser.add_argument("--render-only", action="store_true", help="rebuild the Markdown from the CSV and print it")
    parser.add_argument("--time-check", action="store_true", help="check the time model against one thread's "
                        "measured step time (prints; writes nothing)")
    parser.add_argument("--out-dir", default=None, help="where the CSV and Markdown go (default bench/results)")
    return parser


def _entries(args):
    """The configurations of this run (--quick: the tiny ones; --only filters by model name)."""
    entries = QUICK if args.quick else FULL
    return [e for e in entries if args.only in (e[0] if e[0] != "qwen" else "qwen2.5-0.5b-4l")]


def run(args, csv_path: str | None) -> list[dict]:
    """Each configuration not yet in the CSV: predicted, measured, printed, appended (when csv_path)."""
    done = _results.read_rows(csv_path) if csv_path else []
    rows = list(done)
    for entry in _entries(args):
        spec = spec_of(entry)
        key = key_of(spec)
        if any(_results.matches(r, **key) for r in done):
            print(f"skip (in the CSV): {spec.model_name} {spec.shape()} {spec.label()}", flush=True)
            continue
        try:
            row = measure_row(spec, time_it=not (args.quick or args.no_time))
        except Exception as exc:  # noqa: BLE001 - one configuration failing is a row, not the end of the run
            row = dict(key, status=f"error: {type(exc).__name__}: {str(exc)[:200]}")
        print(f"{spec.model_name} {spec.shape()} {spec.label()}: measured {row.get('measured_bytes', '-')} "
              f"predicted {row.get('predicted_bytes', '-')} error {row.get('error_pct', '-')}% "
              f"[{row['status']}]", flush=True)
        rows.append(row)
        if csv_path:
            _results.append_row(csv_path, row, FIELDS)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run (or re-render) the benchmark; 0 when every row was measured."""
    args = _parser().parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    quiet_transformers()
    if args.time_check:
        print_time_check()
        return 0
    writes = args.out_dir is not None or not args.quick
    csv_path = _results.results_path(NAME, "csv", "cpu", args.out_dir) if writes else None
    md_path = _results.results_path(NAME, "md", "cpu", args.out_dir) if writes else None
    if args.render_only:
        rows = _results.read_rows(csv_path)
    else:
        rows = run(args, csv_path)
    print("\n".join(table(rows, markdown=False)))
    s = summary(rows)
    print(summary_line(s))
    if writes and rows:
        _results.write_text(md_path, markdown(rows, argv))
        print(f"wrote {csv_path} and {md_path}")
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
