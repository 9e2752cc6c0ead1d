#!/usr/bin/env python
"""Saved-for-backward bytes and step time of a Llama-style decoder on the CPU, by attention path.

    python -m bench.attention_memory                    # seq 256, 1024, 2048; writes
                                                        # bench/results/attention_memory_cpu.{csv,md}
    python -m bench.attention_memory --seqs 256,1024,2048,4096 --repeats 3
    python -m bench.attention_memory --quick            # seq 128, one timed run: a smoke check, writes nothing

Model (issue 14): `LlamaForCausalLM(LlamaConfig(hidden 256, 4 layers, 8 heads, 2 KV heads, vocab 8000,
intermediate 512, as `slimfit memory llama-small`))`, randomly initialised (saved bytes do not depend on the
weights' values), fp32, train mode, `attn_implementation="sdpa"` (the transformers default), batch 1 (--batch),
labels = input ids.

Rows (one model object; the frozen set of `ILSScheduler(model, 0.9, seed=0)` at its first step, i.e. 90%
of the candidate layers, for every "+frozen" row):
  plain sdpa, all trainable       plain PyTorch
  plain sdpa, same frozen set     plain PyTorch + the frozen set: the baseline of the ratios
  paper(), materialize            SlimFitConfig.paper().with_attention(path="materialize") + frozen set:
                                  slimfit's attention core before the fused path (fp32 scores, int8 P)
  paper(), auto                   SlimFitConfig.paper() (attention.path="auto": the fused path) + frozen set

Columns (measured by bench/_measure.py): saved bytes of one forward + backward (`slimfit.memory.measure`:
saved-tensor hooks, parameters not counted, a storage counted once), the attention core's share (bytes attributed
to the `self_attn` modules themselves: the attention op and RoPE; the q/k/v/o projections are their own modules),
the LM head + loss share (the `lm_head` module and the model root, where the loss is computed), the total peak of
one whole training step (slimfit.step_memory: forward, backward, AdamW step with lr 0 over the trainable
parameters, zero_grad; AdamW's state made beforehand; its parts at the peak in the CSV), step time (that step
without tracking, median of --repeats runs; runs before the step peak was measured timed forward + backward
only). The LM head is another engineer's work (chunked cross-entropy); what paper() does there is whatever the
tree holds when this runs.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/attention_memory.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import warnings

import torch

from bench import _measure, _results, _timing
from slimfit.config import SlimFitConfig

MiB = 2 ** 20
CONFIG = dict(vocab_size=8000, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, rms_norm_eps=1e-5)

# name -> (preset config or None, frozen set applied)
METHODS = {
    "plain sdpa, all trainable": (None, False),
    "plain sdpa, same frozen set": (None, True),
    "paper(), materialize": (SlimFitConfig.paper().with_attention(path="materialize"), True),
    "paper(), auto": (SlimFitConfig.paper(), True),
}
BASELINE = "plain sdpa, same frozen set"


def build(seq: int):
    """`slimfit memory llama-small` with CONFIG's sizes, positions for `seq`; its batch: input ids as labels."""
    arch, model = _measure.build("llama-small", seq_len=max(seq, 256), **CONFIG)
    return arch, model


def shares(run) -> tuple[int, int]:
    """(attention core bytes, LM head + loss bytes) of a SavedMemory."""
    attn = sum(b for path, b in run.per_module.items() if path.endswith(".self_attn"))
    head = sum(b for path, b in run.per_module.items() if path in ("lm_head", "(root)") or path.startswith("lm_head"))
    return attn, head


def bench_seq(seq: int, args, settings) -> list[dict]:
    arch, model = build(seq)
    inputs = _measure.inputs(model, arch, args.batch, seq)
    inputs = {"input_ids": inputs["input_ids"], "labels": inputs["labels"]}  # no attention mask: causal only
    frozen, candidates = _measure.frozen_set(model, 0.9, seed=0)
    # A scheduler may apply its first frozen set at the model's next forward (a pre-hook that outlives it):
    # let that happen now, on a throwaway forward, so that it cannot change the first measured row.
    with torch.no_grad():
        model(input_ids=inputs["input_ids"][:, :8])
    print(f"\n== seq {seq}, batch {args.batch}: frozen {len(frozen)}/{len(candidates)} candidate layers", flush=True)
    cases = [_measure.Case(method, lambda config=config, use=use_frozen: _measure.configured(
        model, inputs, config=config, frozen=frozen if use else []))
        for method, (config, use_frozen) in METHODS.items()]
    what = _measure.What(peak=not args.no_peak, time=settings if args.repeats > 0 else None)
    rows = []
    for case, result in _measure.run(cases, what):
        run, t = result.saved, result.timing
        attn, head = shares(run)
        rows.append({"seq": seq, "batch": args.batch, "method": case.name, "saved_bytes": run.total,
                     "attention_bytes": attn, "lm_head_loss_bytes": head,
                     "step_ms": None if t is None else round(t.ms, 1), "reps": 0 if t is None else t.reps,
                     **_measure.peak_columns(result)})
        peak = "" if result.peak is None else f"   step peak {result.peak.total / MiB:8.1f} MiB"
        print(f"  {case.name:<28} {run.total / MiB:9.2f} MiB   attention {attn / MiB:8.2f} MiB   "
              f"head+loss {head / MiB:8.2f} MiB{peak}" + (f"   step {t.ms:8.0f} ms (median of {t.reps})" if t else ""),
              flush=True)
    base = next(r for r in rows if r["method"] == BASELINE)
    for r in rows:
        r["ratio_vs_frozen_plain"] = round(base["saved_bytes"] / r["saved_bytes"], 3)
        r["attention_ratio_vs_frozen_plain"] = (round(base["attention_bytes"] / r["attention_bytes"], 2)
                                                if r["attention_bytes"] else None)
    return rows


def table(rows: list[dict]) -> list[str]:
    head = ["seq", "method", "saved MiB", "vs plain same frozen", "attention MiB", "attention vs plain frozen",
            "LM head + loss MiB", "step peak MiB", "step ms"]
    body = []
    for r in rows:
        ar = r["attention_ratio_vs_frozen_plain"]
        peak = r.get("step_peak_bytes")
        body.append([str(r["seq"]), r["method"], f"{r['saved_bytes'] / MiB:.1f}", f"{r['ratio_vs_frozen_plain']:.2f}x",
                     f"{r['attention_bytes'] / MiB:.1f}", "-" if ar is None else f"{ar:.2f}x",
                     f"{r['lm_head_loss_bytes'] / MiB:.1f}", "-" if peak in (None, "") else f"{peak / MiB:.1f}",
                     "-" if r["step_ms"] is None else f"{r['step_ms']:,.0f}"])
    return _results.md_table(head, body, right=[0, *range(2, len(head))])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="256,1024,2048")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="timed training steps per row (0: not timed)")
    ap.add_argument("--no-peak", action="store_true", help="no total step peak (saved bytes and time only)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-timer", choices=("wall", "process"), default="wall",
                    help="process: CPU time of the process (robust to a busy machine; use with --threads 1)")
    ap.add_argument("--quick", action="store_true", help="seq 128, one timed run; writes nothing")
    ap.add_argument("--out", default=_results.results_path("attention_memory", "", "cpu"),
                    help="path of the results without extension (.csv and .md are added)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    seqs = [128] if args.quick else [int(s) for s in args.seqs.split(",")]
    settings = (_timing.Settings.quick() if args.quick else
                _timing.Settings(cpu_warmup=0, cpu_min_reps=max(1, args.repeats), cpu_min_time_s=0.0,
                                 cpu_max_reps=max(1, args.repeats), cpu_slow_min_reps=max(1, args.repeats),
                                 cpu_clock=args.cpu_timer))
    warnings.filterwarnings("ignore", message=".*was not patched.*")
    rows = []
    for seq in seqs:
        rows += bench_seq(seq, args, settings)
    lines = table(rows)
    print("\n" + "\n".join(lines))
    if args.quick:
        return
    _results.write_rows(args.out + ".csv", rows)
    command = _results.command("attention_memory", ["--seqs", args.seqs, "--batch", args.batch, "--repeats",
                                                    args.repeats, "--threads", torch.get_num_threads(),
                                                    "--cpu-timer", args.cpu_timer])
    header = [
        "# Attention paths on a Llama-style decoder, CPU",
        "",
        f"`{command}`; "
        f"{_results.now()}, {_results.cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"step time as {'CPU time of the process' if args.cpu_timer == 'process' else 'wall time'}, "
        f"load average {_results.load_average()}.",
        "",
        "Model: LlamaForCausalLM, hidden 256, 4 layers, 8 heads, 2 KV heads, vocab 8000, intermediate 512, fp32, "
        "sdpa, random init. Frozen set: ILSScheduler(model, 0.9, seed=0) at its first step. Bytes: saved for "
        "backward in one forward + backward (slimfit.memory.measure). \"attention\": bytes of the `self_attn` "
        "modules themselves (attention op + RoPE; projections not included). Step peak: the total peak of one "
        "training step (forward, backward, AdamW with lr 0, zero_grad; AdamW state resident; slimfit.step_memory). "
        "Step: that step, median.",
        "",
    ]
    _results.write_text(args.out + ".md", "\n".join(header + lines) + "\n")
    print(f"\nwrote {args.out}.csv and {args.out}.md")


if __name__ == "__main__":
    main()
