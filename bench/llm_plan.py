#!/usr/bin/env python
"""`slimfit plan` at the shapes LLMs are fine-tuned at: the predicted whole-step peak of the recipes people run,
next to the public numbers, with no GPU and no download.

    python -m bench.llm_plan                  # every case, bench/results/llm_plan.{csv,md}
    python -m bench.llm_plan --only llama-3.2-3b --fit 24GiB   # one model, plus --fit's pick under 24 GiB
    python -m bench.llm_plan --quick --out-dir /tmp/x         # tiny decoders (the smoke test)
    python -m bench.llm_plan --rows slimfit   # re-plan the rows whose label starts so; the others kept from the csv
    python -m bench.llm_plan --render-only    # the markdown again from the csv (a --rows run stopped part way)

Each row is one StepSpec predicted on fake tensors (slimfit/memory/plan/), full depth, bf16 weights (the model
and AdamW's moments in bf16, as torch makes them), on fake CUDA (--device cuda: CUDA's attention backends):
  plain             torch AdamW, sdpa attention;
  torchtune recipe  8-bit AdamW (torchao's AdamW8bit: its compiled step makes two fp32 temporaries of the
                    parameter it steps, measured on the CPU) + activation checkpointing of every layer + the
                    optimizer step in backward + chunked CE (StepSpec step_in_backward, chunked_loss); its paged
                    optimizer state (which moves the 8-bit moments to the host under pressure), compile and
                    activation offload are NOT modelled: the row keeps every 8-bit moment on the device;
  the same with bitsandbytes' AdamW8bit (not paged): the same bytes of state to within its 256-entry maps,
                    and a fused CUDA step that allocates nothing (optim8bit.FakeBnbAdamW8bit): the strongest
                    8-bit recipe on a GPU; --device cuda only;
  LoRA r8 + ckpt    peft's default targets at rank 8, checkpointing;
  slimfit defaults  slimfit.patch(paper()) + ILSScheduler at rate 0.7 (its default optimizer_state: every AdamW
                    state 8-bit), the first step's frozen set;
  slimfit defaults, the table held  the same with embeddings="freeze" (the input embedding table, and a head tied
                    to it, held frozen for the run: no gradient, no state);
  slimfit + step in backward + ckpt, 8-bit  the same with checkpointing and the step in backward;
  slimfit + step in backward + ckpt, 4-bit  ... with every moment 4-bit (state_code="dynamic4");
  slimfit + step in backward + ckpt, host   ... with optimizer_state="host": every moment in host memory, each
                    trained parameter's streamed in for its step and back a piece at a time (lossless; what a
                    paged optimizer does under pressure, without a whole parameter's moments on the device).
                    `host s` is that traffic's time (plan/cost.py's host_traffic_seconds: 25 GB/s each way, a
                    PCIe Gen5 x16 link's practical rate), which the plan's step time leaves out;
  slimfit + step in backward + ckpt, host, table held   ... and embeddings="freeze" (the input embedding, and a
                    tied head, held frozen for the run);
with the step time of plan/cost.py (nominal H100-class rates: for ranking, not a benchmark).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/llm_plan.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import sys
import time

from bench import _results

NAME = "llm_plan"
GiB = 2 ** 30
FIELDS = ["model", "batch", "seq", "row", "peak_gib", "weights_gib", "grads_gib", "state_gib", "saved_gib",
          "transient_gib", "peak_phase", "est_step_s", "host_s", "plan_s", "commit"]
# (model, batch, seq): the public recipes' shapes first (torchtune's README), then the other shipped configs
CASES = [("llama-3.1-8b", 2, 2048), ("llama-3.2-3b", 2, 4096), ("qwen2.5-0.5b", 1, 1024),
         ("llama-3.2-1b", 1, 1024), ("qwen2.5-1.5b", 1, 1024), ("qwen2.5-7b", 2, 2048)]
QUICK = [("llama-tiny", 1, 32)]
_SLIMFIT_IN_BACKWARD = dict(preset="paper", rate=0.7, checkpointing=True, step_in_backward=True)
ROWS = {"plain bf16, AdamW": {},
        "torchtune recipe without paging: 8-bit AdamW + ckpt + step in backward + chunked CE":
            dict(optimizer="adamw8bit", checkpointing=True, step_in_backward=True, chunked_loss=True),
        "the same recipe with bitsandbytes' AdamW8bit (its fused step: no temporaries)":
            dict(optimizer="adamw8bit-bnb", checkpointing=True, step_in_backward=True, chunked_loss=True),
        "LoRA r8 + checkpointing": dict(lora=8, checkpointing=True),
        "slimfit defaults: paper(), rate 0.7": dict(preset="paper", rate=0.7),
        "slimfit defaults, the input embedding held frozen (embeddings='freeze')":
            dict(preset="paper", rate=0.7, embeddings="freeze"),
        "slimfit + ckpt + step in backward, every state 8-bit": {**_SLIMFIT_IN_BACKWARD, "optimizer_state": "8bit"},
        "slimfit + ckpt + step in backward, every moment 4-bit": {**_SLIMFIT_IN_BACKWARD, "optimizer_state": "8bit",
                                                                  "state_code": "dynamic4"},
        "slimfit + ckpt + step in backward, every state on the host": {**_SLIMFIT_IN_BACKWARD,
                                                                       "optimizer_state": "host"},
        "slimfit + ckpt + step in backward, every state on the host, the input embedding held frozen":
            {**_SLIMFIT_IN_BACKWARD, "optimizer_state": "host", "embeddings": "freeze"}}
CUDA_ONLY = {"adamw8bit-bnb"}   # optimizers planned for a GPU only (StepSpec.optimizer)
PUBLIC = {("llama-3.1-8b", 2, 2048): "torchtune: 18.9 GiB (bf16 + 8-bit paged AdamW + step in backward + "
                                     "checkpointing + chunked CE, RTX 4090)",
          ("llama-3.2-3b", 2, 4096): "torchtune: 17.6 GiB with every flag stacked (from 60.0 GiB)"}


def predict_row(model: str, batch: int, seq: int, fields: dict, device: str) -> dict:
    """One configuration predicted: its peak and parts in GiB, where the peak is, the estimated step time."""
    from slimfit.plan import StepSpec, predict

    spec = StepSpec(model, batch=batch, seq=seq, dtype="bf16", device=device, **{"rate": 0.0, **fields})
    p = predict(spec)
    m = p.memory
    return {"model": model, "batch": batch, "seq": seq, "peak_gib": f"{m.total / GiB:.2f}",
            "weights_gib": f"{m.weights / GiB:.2f}", "grads_gib": f"{m.gradients / GiB:.2f}",
            "state_gib": f"{m.optimizer_state / GiB:.2f}", "saved_gib": f"{m.saved / GiB:.2f}",
            "transient_gib": f"{m.transient / GiB:.2f}", "peak_phase": m.peak_phase,
            "est_step_s": f"{p.step_time():.3g}", "host_s": _host_seconds(spec, p), "plan_s": f"{p.seconds:.0f}",
            "commit": _results.commit_label()}


def _host_seconds(spec, p) -> str:
    """The host traffic of optimizer_state="host" per step (plan/cost.py's host_traffic_seconds: each trained
    parameter's two moments, in the weights' dtype as torch makes them, in and out); "-" for other rows."""
    from slimfit.memory.plan.cost import host_traffic_seconds

    if spec.optimizer_state != "host":
        return "-"
    return f"{host_traffic_seconds(p.trained, spec.moment_bytes):.2f}"


def fit_row(model: str, batch: int, seq: int, budget: str, device: str) -> dict:
    """--fit's pick under the budget (search.py), as a row; its label names the configuration."""
    from slimfit.memory.plan.search import fit
    from slimfit.memory.units import parse_bytes
    from slimfit.plan import StepSpec

    start = time.perf_counter()
    result = fit(StepSpec(model, batch=batch, seq=seq, dtype="bf16", device=device), parse_bytes(budget),
                 on_progress=lambda line: print(f"    {line}", file=sys.stderr, flush=True))
    took = time.perf_counter() - start
    if result.best is None:
        return {"model": model, "batch": batch, "seq": seq, "row": f"--fit {budget}: nothing fits",
                "plan_s": f"{took:.0f}"}
    p = result.best.prediction
    m = p.memory
    return {"model": model, "batch": batch, "seq": seq, "row": f"--fit {budget}: {p.spec.label()}",
            "peak_gib": f"{m.total / GiB:.2f}", "weights_gib": f"{m.weights / GiB:.2f}",
            "grads_gib": f"{m.gradients / GiB:.2f}", "state_gib": f"{m.optimizer_state / GiB:.2f}",
            "saved_gib": f"{m.saved / GiB:.2f}", "transient_gib": f"{m.transient / GiB:.2f}",
            "peak_phase": m.peak_phase, "est_step_s": f"{p.step_time():.3g}", "plan_s": f"{took:.0f}",
            "commit": _results.commit_label()}


def markdown(rows: list[dict], argv: list[str], device: str) -> str:
    """The results file: header (command, commit, date, versions), what each row is, the table, the public
    numbers it compares with."""
    head = ["model", "b", "seq", "configuration", "step peak GiB", "weights", "grads", "opt. state", "saved",
            "transient", "peak in", "est. step s", "host s", "plan s"]
    body = [[r["model"], r["batch"], r["seq"], r["row"], r.get("peak_gib", "-"), r.get("weights_gib", "-"),
             r.get("grads_gib", "-"), r.get("state_gib", "-"), r.get("saved_gib", "-"), r.get("transient_gib", "-"),
             r.get("peak_phase", "-"), r.get("est_step_s", "-"), r.get("host_s", "-"), r.get("plan_s", "-")]
            for r in rows]
    lines = [f"# slimfit plan at LLM scale: predicted whole-step peaks ({device}, bf16 weights)", "",
             f"`{_results.command(NAME, argv)}`; rows of commit {_commits(rows)}; {_results.now()}; torch "
             f"{_results.versions()['torch']}; planned on {_results.device_name('cpu')}.", "",
             "Every row is predicted on fake tensors at full depth (every layer; nothing allocated, no weights "
             "downloaded: the configs of slimfit/memory/models.py). The parts are at the peak; `saved` is what "
             "autograd keeps for backward. The step time is plan/cost.py's estimate with nominal H100-class "
             "rates (for ranking configurations, not a benchmark); `host s` is the host traffic of the rows "
             "that keep the moments in host memory, which that estimate leaves out. bench/llm_plan.py's "
             "docstring says what each row models; the torchtune rows leave out the recipe's paged optimizer "
             "state and activation offload: every 8-bit moment stays on the device there.", ""]
    lines += _results.md_table(head, body, right=set(range(4, 14)) - {10})
    public = [f"- {m} b{b} s{s}: {text}" for (m, b, s), text in PUBLIC.items()
              if any(r["model"] == m and int(r["batch"]) == b and int(r["seq"]) == s for r in rows)]
    if public:
        lines += ["", "Public numbers at the same shapes (measured on a GPU, so they add the CUDA context and the "
                  "allocator's slack):", ""] + public
    return "\n".join(lines) + "\n"


def _commits(rows: list[dict]) -> str:
    """The commits the rows were planned at (a row planned before the column: the file's first commit)."""
    seen = dict.fromkeys(r.get("commit") or "0c2ff5f" for r in rows)
    return "; ".join(seen)


def _in_order(rows: list[dict]) -> list[dict]:
    """The rows in CASES x ROWS order (a row of neither last, in the csv's order)."""
    cases = {c[0]: i for i, c in enumerate(CASES)}
    labels = {label: i for i, label in enumerate(ROWS)}
    return sorted(rows, key=lambda r: (cases.get(r["model"], len(cases)), labels.get(r["row"], len(labels))))


def _csv_rows(path: str, pattern: str | None) -> dict:
    """{(model, batch, seq, row): row} of the csv with --rows (empty without): its rows are kept, and those whose
    label starts with `pattern` are re-planned unless planned at this commit already (a run that stopped resumes)."""
    if pattern is None:
        return {}
    return {(r["model"], int(r["batch"]), int(r["seq"]), r["row"]): r for r in _results.read_rows(path)}


def _wanted(label: str, old: dict | None, pattern: str | None) -> bool:
    """Whether the row is planned now: always without --rows; with it, a row of the pattern not planned at this
    commit yet, or a row the csv lacks."""
    if pattern is None or old is None:
        return pattern is None or label.startswith(pattern)
    return label.startswith(pattern) and old.get("commit") != _results.commit_label()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny decoder only (the smoke test)")
    p.add_argument("--only", default=None, help="models whose name contains this")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="the planned step's device")
    p.add_argument("--fit", default=None, metavar="BUDGET", help="add --fit's pick under BUDGET (e.g. 24GiB)")
    p.add_argument("--out-dir", default=None, help="where the results go (default bench/results)")
    p.add_argument("--rows", default=None, metavar="PREFIX",
                   help="re-plan only the rows whose label starts with PREFIX (e.g. slimfit); keep the csv's others")
    p.add_argument("--render-only", action="store_true", help="the markdown again from the csv")
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    cases = [c for c in (QUICK if args.quick else CASES) if args.only is None or args.only in c[0]]
    csv_path = _results.results_path(NAME, "csv", out_dir=args.out_dir)
    md_path = _results.results_path(NAME, "md", out_dir=args.out_dir)
    if args.render_only:
        _results.write_text(md_path, markdown(_in_order(_results.read_rows(csv_path)), ["--rows", "slimfit"],
                                              args.device))
        return 0
    old = _csv_rows(csv_path, args.rows)
    rows = []
    for model, batch, seq in cases:
        for label, fields in ROWS.items():
            if args.device != "cuda" and fields.get("optimizer") in CUDA_ONLY:
                continue
            kept = old.get((model, batch, seq, label))
            if not _wanted(label, kept, args.rows):
                if kept is not None:
                    rows.append(kept)
                continue
            rows.append({**predict_row(model, batch, seq, fields, args.device), "row": label})
            r = rows[-1]
            print(f"{model:14s} b{batch} s{seq:<5d} {label:60s} {r['peak_gib']:>8} GiB  "
                  f"({r['plan_s']} s to plan)", flush=True)
            if args.rows is not None:   # each row as it lands, the csv's later rows still in
                done = {(x["model"], int(x["batch"]), int(x["seq"]), x["row"]) for x in rows}
                later = [x for k, x in old.items() if k not in done and (k[0], k[1], k[2]) in cases]
                _results.write_rows(csv_path, rows + later, FIELDS)
        if args.fit:
            rows.append(fit_row(model, batch, seq, args.fit, args.device))
            print(f"{model:14s} b{batch} s{seq:<5d} {rows[-1]['row']}: {rows[-1].get('peak_gib', '-')} GiB "
                  f"({rows[-1]['plan_s']} s to search)", flush=True)
    if args.quick and args.out_dir is None:
        return 0
    # with --rows, the csv's rows of the models --only left out stay too
    rows += [r for k, r in old.items() if (k[0], k[1], k[2]) not in cases]
    _results.write_rows(csv_path, rows, FIELDS)
    _results.write_text(md_path, markdown(rows, argv, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
