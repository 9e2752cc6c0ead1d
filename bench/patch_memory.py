#!/usr/bin/env python
"""Saved-activation bytes and step time of real model families patched with slimfit, on the CPU.

    python -m bench.patch_memory               # BERT-base (seq 128), ViT-B/16 (224), Llama-tiny and SmolLM-135M
                                               # (Llama layout, seq 128), batch 2; writes
                                               # bench/results/patch_memory_cpu.{csv,md}; ~15-20 min on 2 busy cores
    python -m bench.patch_memory --quick       # 2-layer models, seq 64, one timed run: a smoke check, writes nothing
    python -m bench.patch_memory --models bert --batch 4 --repeats 5 --threads 1 --cpu-timer process

Models: `BertForSequenceClassification(BertConfig())` (BERT-base: 12 layers, hidden 768, 12 heads),
`ViTForImageClassification(ViTConfig())` (ViT-B/16 at 224x224), and two `LlamaForCausalLM`s (`slimfit memory`'s
llama-tiny: 2 layers, hidden 64; smollm-135m: SmolLM-135M's sizes), randomly initialised (the bytes
saved for backward do not depend on the weights' values), train mode, dropout on, fp32,
`attn_implementation="sdpa"` (the transformers default) unless said otherwise.

Rows (one model object; patched and unpatched in turn, same parameters, same batch, same dropout seed):
  plain              plain PyTorch, every parameter trainable: the baseline of every ratio
  plain-eager        the same with eager attention (softmax(QK^T) materialised by the model code)
  plain+frozen       plain PyTorch with the frozen set below: what freezing alone buys
  exact+frozen       slimfit.patch(model, SlimFitConfig.exact()) + the frozen set
  paper+frozen       slimfit.patch(model, SlimFitConfig.paper()) + the frozen set
  aggressive+frozen  slimfit.patch(model, SlimFitConfig.aggressive()) + the frozen set
  wta_crs+frozen     slimfit.patch(model, SlimFitConfig.wta_crs()) + the frozen set (paper() + sampled weight
                     gradients of the trainable attention-output / FFN linears, 30% of the rows; no sample ids:
                     the bytes do not depend on them)

Frozen set: what `ILSScheduler(model, freeze_rate=0.9, seed=0)` freezes at its first step, i.e. a
seeded random 90% of its candidate layers (weight matrices, embeddings, LayerNorm weights; biases
always train), the same set for every "+frozen" row. Which 10% train changes the bytes, so the
paper() ratio is also measured for the frozen sets of seeds 1..(--frozen-seeds - 1) (bytes only).

Measured per row by bench/_measure.py. Saved bytes: `slimfit.memory.measure` (saved-tensor hooks; parameters
and buffers not counted; a storage saved twice counts once) of one forward + backward, divided by the batch
size. Step peak: the total peak of one whole training step (slimfit.step_memory: forward, backward, AdamW step
with lr 0 over the trainable parameters, zero_grad; AdamW's state made beforehand), for the whole batch, with its
parts at the peak in the CSV. Step time: that same step without tracking, median of --repeats runs (runs before
the step peak was measured timed forward + backward only).
The issue-5 target (BERT-base + paper() + 90% frozen saves >= 6x fewer activation bytes than the
unpatched model at seq 128) is checked against the `plain` row and printed, met or not.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/patch_memory.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import contextlib
import dataclasses
import re
import sys
import warnings
from dataclasses import dataclass, field

import torch

import slimfit
from bench import _measure, _results, _timing
from slimfit import architectures as archs
from slimfit.kernels import backend_info

MiB = 2 ** 20
TARGET = 6.0

# name -> (attention implementation, preset or None, frozen set applied)
METHODS = {
    "plain": ("sdpa", None, False),
    "plain-eager": ("eager", None, False),
    "plain+frozen": ("sdpa", None, True),
    "exact+frozen": ("sdpa", "exact", True),
    "paper+frozen": ("sdpa", "paper", True),
    "aggressive+frozen": ("sdpa", "aggressive", True),
    "wta_crs+frozen": ("sdpa", "wta_crs", True),
}


@dataclass
class Row:
    model: str
    method: str
    shape: str
    batch: int
    frozen_seed: int | None
    frozen_layers: int
    candidate_layers: int
    frozen_weight_share: float
    saved_bytes: int
    per_sample: float
    ratio: float = 0.0
    step_ms: float | None = None
    reps: int = 0
    run: object = field(default=None, repr=False)  # SavedMemory
    peak: object = field(default=None, repr=False)  # StepMemory (None: not measured)


def model_specs(args) -> list[tuple[str, archs.Architecture, dict]]:
    """(label, architecture, build overrides) per requested model; --quick keeps 2 layers."""
    out = []
    for key in args.models.split(","):
        key = key.strip().lower()
        if key in ("bert", "bert-base"):
            arch = archs.ARCHITECTURES["bert-base"]
            label = "BERT-base"
        elif key in ("vit", "vit-base"):
            arch = archs.ARCHITECTURES["vit-base"]
            label = "ViT-B/16"
            if args.vit_dropout is not None:
                arch = dataclasses.replace(arch, config={**arch.config, "hidden_dropout_prob": args.vit_dropout,
                                                         "attention_probs_dropout_prob": args.vit_dropout})
        elif key in ("llama-tiny", "smollm", "smollm-135m"):
            arch = archs.resolve(key)
            label = "Llama-tiny" if key == "llama-tiny" else "SmolLM-135M"
        else:
            raise SystemExit(f"--models: unknown model {key!r} (bert, vit, llama-tiny, smollm)")
        if args.quick:
            arch = dataclasses.replace(arch, name=arch.name + "-2l", config={**arch.config, "num_hidden_layers": 2},
                                       about=arch.about + " (2 layers)")
            label += " (2 layers)"
        out.append((label, arch))
    return out


def bench_model(label: str, arch: archs.Architecture, args, settings: _timing.Settings) -> tuple[list[Row], dict]:
    arch, model = _measure.build(arch)
    inputs = _measure.inputs(model, arch, args.batch, args.seq_len, args.image_size)
    shape = (f"seq {args.seq_len}" if arch.task != archs.IMAGE_CLS
             else f"{inputs['pixel_values'].shape[-1]}x{inputs['pixel_values'].shape[-2]}")
    frozen, candidates = _measure.frozen_set(model, args.freeze_rate, seed=0)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    share = lambda names: sum(numel[n] for n in names) / max(1, sum(numel[n] for n in candidates))  # noqa: E731
    print(f"\n== {label}: {sum(numel.values()) / 1e6:.1f}M parameters, batch {args.batch}, {shape}; frozen "
          f"{len(frozen)}/{len(candidates)} candidate layers ({100 * share(frozen):.1f}% of their weights)",
          flush=True)
    summaries = {}

    def case(method, attn, preset, names):
        @contextlib.contextmanager
        def open_():
            with _measure.configured(model, inputs, config=preset, frozen=names, attn=attn) as setup:
                if preset is not None:
                    summaries[method] = model.slimfit_summary
                yield setup
        return _measure.Case(method, open_, {"names": names})

    cases = [case(m, attn, preset, frozen if use_frozen else []) for m, (attn, preset, use_frozen) in METHODS.items()]
    what = _measure.What(peak=not args.no_peak, time=settings if args.repeats > 0 else None)
    rows: list[Row] = []
    for c, result in _measure.run(cases, what):
        names = c.meta["names"]
        t = result.timing
        rows.append(Row(label, c.name, shape, args.batch, 0 if names else None, len(names), len(candidates),
                        share(names), result.saved.total, result.saved.total / args.batch,
                        step_ms=t.ms if t else None, reps=t.reps if t else 0, run=result.saved, peak=result.peak))
        _print_row(rows[-1])
    rows += _other_frozen_sets(label, model, inputs, shape, candidates, share, args)
    base = rows[0].saved_bytes
    for r in rows:
        r.ratio = base / r.saved_bytes if r.saved_bytes else float("inf")
    return rows, summaries


def _print_row(r: Row) -> None:
    peak = "" if r.peak is None else f"   step peak {r.peak.total / MiB:9.1f} MiB"
    step = "" if r.step_ms is None else f"   step {r.step_ms:8.0f} ms (median of {r.reps})"
    print(f"  {r.method:<18} {r.per_sample / MiB:9.2f} MiB/sample{peak}{step}", flush=True)


def _other_frozen_sets(label, model, inputs, shape, candidates, share, args) -> list[Row]:
    """paper() with the frozen sets of seeds 1.. (bytes only)."""
    rows = []
    for fseed in range(1, args.frozen_seeds):
        fz, _ = _measure.frozen_set(model, args.freeze_rate, seed=fseed)
        case = _measure.Case("paper+frozen", lambda fz=fz: _measure.configured(model, inputs, config="paper",
                                                                               frozen=fz))
        ((_, result),) = _measure.run([case], _measure.What(peak=False))
        run = result.saved
        rows.append(Row(label, "paper+frozen", shape, args.batch, fseed, len(fz), len(candidates), share(fz),
                        run.total, run.total / args.batch, run=run))
        print(f"  paper+frozen (frozen set of seed {fseed}) {run.total / args.batch / MiB:9.2f} MiB/sample", flush=True)
    return rows


# ------------------------------------------------------------------ reporting
def _fmt_ms(ms):
    return "-" if ms is None else f"{ms:,.0f}"


def _peak(r: Row, plain: Row | None) -> tuple[str, str]:
    if r.peak is None:
        return "-", "-"
    ratio = "-" if plain is None or plain.peak is None else f"{plain.peak.total / r.peak.total:.2f}x"
    return f"{r.peak.total / MiB:,.1f}", ratio


def main_table(rows: list[Row], md: bool) -> list[str]:
    head = ["model", "method", "frozen layers", "frozen weights", "MiB/sample", "vs plain", "step peak MiB",
            "peak: plain / row", "step ms"]
    plain = {r.model: r for r in rows if r.method == "plain"}
    body = [[r.model, r.method, f"{r.frozen_layers}/{r.candidate_layers}", f"{100 * r.frozen_weight_share:.1f}%",
             f"{r.per_sample / MiB:.2f}", f"{r.ratio:.2f}x", *_peak(r, plain.get(r.model)), _fmt_ms(r.step_ms)]
            for r in rows if r.frozen_seed in (None, 0)]
    return _table(head, body, md, right=(2, 3, 4, 5, 6, 7, 8))


def seed_table(rows: list[Row], md: bool) -> list[str]:
    """paper()+frozen for each seeded frozen set."""
    head = ["model", "frozen set seed", "frozen layers", "frozen weights", "MiB/sample", "vs plain"]
    body = [[r.model, str(r.frozen_seed), f"{r.frozen_layers}/{r.candidate_layers}",
             f"{100 * r.frozen_weight_share:.1f}%", f"{r.per_sample / MiB:.2f}", f"{r.ratio:.2f}x"]
            for r in rows if r.method == "paper+frozen"]
    return _table(head, body, md, right=(1, 2, 3, 4, 5))


def _table(head, body, md, right=()):
    return (_results.md_table if md else _results.text_table)(head, body, right)


def role_table(plain: Row, paper: Row, batch: int, md: bool, top: int) -> list[str]:
    """paper() vs plain per role (layer index collapsed), largest paper() bytes first."""
    p = archs.collapse_layers(plain.run)
    s = archs.collapse_layers(paper.run)
    keys = sorted(set(p.per_module) | set(s.per_module),
                  key=lambda k: (-s.per_module.get(k, 0), -p.per_module.get(k, 0)))
    def red(a, b):
        if b == 0:
            return "-" if a == 0 else "inf"
        if a == 0:
            return "n/a"
        return ">1000x" if a / b > 1000 else f"{a / b:.1f}x"

    body = []
    for k in keys[:top]:
        a, b = p.per_module.get(k, 0), s.per_module.get(k, 0)
        body.append([k, f"{a / batch / MiB:.3f}", f"{b / batch / MiB:.3f}", f"{100 * b / s.total:.1f}%", red(a, b)])
    rest_p = sum(p.per_module.get(k, 0) for k in keys[top:])
    rest_s = sum(s.per_module.get(k, 0) for k in keys[top:])
    body.append([f"(other {max(0, len(keys) - top)} roles)", f"{rest_p / batch / MiB:.3f}",
                 f"{rest_s / batch / MiB:.3f}", f"{100 * rest_s / s.total:.1f}%", red(rest_p, rest_s)])
    body.append(["total", f"{p.total / batch / MiB:.3f}", f"{s.total / batch / MiB:.3f}", "100.0%",
                 f"{p.total / s.total:.1f}x"])
    return _table(["module (all layers)", "plain MiB/sample", "paper MiB/sample", "share", "reduction"], body, md,
                  right=(1, 2, 3, 4))


def _indices(path: str) -> str:
    return ".".join(re.findall(r"(?<=\.)\d+(?=\.|$)", path))


def _ranges(indices: list[str]) -> str:
    """['0', '1', '2', '5'] -> '0-2, 5' (non-integer indices such as '3.1' are listed as they are)."""
    if not all(i.isdigit() for i in indices):
        return ", ".join(indices)
    nums = sorted(int(i) for i in indices)
    parts, start = [], nums[0]
    for a, b in zip(nums, nums[1:] + [None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(parts)


def top_modules(paper: Row, batch: int, md: bool, top: int) -> list[str]:
    """The largest single modules of paper()+frozen; modules of one role that save the same
    bytes (every layer alike) share a row that lists their layer indices."""
    groups: dict[tuple[str, int], list[str]] = {}
    for path, nbytes in paper.run.per_module.items():
        if nbytes:
            groups.setdefault((archs.collapse_layers_name(path), nbytes), []).append(_indices(path))
    items = sorted(groups.items(), key=lambda kv: -kv[0][1])[:top]
    body = []
    for (role, nbytes), idx in items:
        listed = [i for i in idx if i]
        where = f" [layer{'s' if len(listed) > 1 else ''} {_ranges(listed)}]" if listed else ""
        body.append([role + where, f"{nbytes / batch / 1024:.1f}", str(len(idx)),
                     f"{100 * nbytes * len(idx) / paper.run.total:.1f}%"])
    return _table(["module (same bytes in the layers listed)", "KiB/sample each", "modules", "share (all)"],
                  body, md, right=(1, 2, 3))


def _llama_lines(rows: list[Row]) -> list[str]:
    out = []
    for model in dict.fromkeys(r.model for r in rows if r.model.startswith(("Llama", "SmolLM"))):
        by = {r.method: r for r in rows if r.model == model and r.frozen_seed in (None, 0)}
        plain, paper = by["plain"].run, by["paper+frozen"].run
        root = plain.per_module.get("(root)", 0), paper.per_module.get("(root)", 0)
        without_root = (plain.total - root[0]) / (paper.total - root[1])
        out.append(f"{model}: paper()+frozen saves {by['paper+frozen'].ratio:.2f}x fewer activation bytes than plain "
                   f"(freezing alone {by['plain+frozen'].ratio:.2f}x, "
                   f"aggressive() {by['aggressive+frozen'].ratio:.2f}x, wta_crs() {by['wta_crs+frozen'].ratio:.2f}x); "
                   f"without the loss's logits ((root), {100 * root[0] / plain.total:.0f}% of plain): "
                   f"{without_root:.2f}x")
    return out


def target_lines(rows: list[Row], quick: bool) -> list[str]:
    bert = [r for r in rows if r.model.startswith("BERT-base") and r.method == "paper+frozen"]
    if not bert:
        return ["issue-5 target (BERT-base, paper(), 90% frozen, seq 128: >= 6x): not measured (BERT not run)"]
    main = next(r for r in bert if r.frozen_seed == 0)
    worst = min(r.ratio for r in bert)
    eager = next(r for r in rows if r.model == main.model and r.method == "plain-eager")
    verdict = "MET" if main.ratio >= TARGET and worst >= TARGET else ("MET for seed 0 only" if main.ratio >= TARGET
                                                                     else "NOT MET")
    qual = " (--quick: 2-layer model, not the target's configuration)" if quick else ""
    weights = ", ".join(f"{100 * r.frozen_weight_share:.0f}%" for r in bert)
    return [f"issue-5 target: BERT-base + paper() + {main.frozen_layers}/{main.candidate_layers} layers frozen saves "
            f">= {TARGET:.0f}x fewer activation bytes than the unpatched model ({main.shape}): {verdict}{qual}",
            f"  paper()+frozen vs plain (sdpa, the transformers default): {main.ratio:.2f}x for the frozen set "
            f"of seed 0; "
            f"worst over {len(bert)} seeded frozen sets: {worst:.2f}x (frozen weights: {weights}); vs plain eager "
            f"attention: {eager.saved_bytes / main.saved_bytes:.2f}x"]


def header_lines(args, load0, load1) -> list[str]:
    import transformers

    v = _results.versions()
    return [
        f"device: cpu, {_results.device_name('cpu')}",
        f"torch {v['torch']}, transformers {transformers.__version__}, python {v['python']}, slimfit "
        f"{slimfit.__version__}, CPU kernels: {backend_info()['cpu']}",
        f"date: {_results.now()}; load average (1 min) at start {load0}, at end {load1}",
        f"batch {args.batch}, seq {args.seq_len} (text models), image {args.image_size or 224} (ViT), fp32, "
        f"train mode; "
        f"dropout: BERT 0.1, ViT {args.vit_dropout if args.vit_dropout is not None else '0.0 (ViTConfig default)'}; "
        f"freeze rate {args.freeze_rate}; timer {args.cpu_timer}, median of {args.repeats}",
    ]


CSV_FIELDS = ["model", "method", "shape", "batch", "frozen_seed", "frozen_layers", "candidate_layers",
              "frozen_weight_share", "saved_bytes", "saved_bytes_per_sample", "ratio_vs_plain", "step_ms", "reps",
              "timer", "device", "cpu", "threads", "torch", "transformers", "slimfit", "cpu_kernels", "load_avg",
              "date", *_measure.PEAK_COLUMNS]


def write_results(out_dir: str | None, args, argv, rows, summaries_by_model, load0, load1, notes):
    import transformers

    csv_path = _results.results_path("patch_memory", "csv", "cpu", out_dir)
    md_path = _results.results_path("patch_memory", "md", "cpu", out_dir)
    v = _results.versions()
    common = dict(timer=args.cpu_timer, device="cpu", cpu=_results.cpu_model(), threads=torch.get_num_threads(),
                  torch=v["torch"], transformers=transformers.__version__, slimfit=slimfit.__version__,
                  cpu_kernels=backend_info()["cpu"], load_avg=f"{load0}/{load1}", date=_results.now())
    _results.write_rows(csv_path, [
        dict(model=r.model, method=r.method, shape=r.shape, batch=r.batch,
             frozen_seed="" if r.frozen_seed is None else r.frozen_seed, frozen_layers=r.frozen_layers,
             candidate_layers=r.candidate_layers, frozen_weight_share=f"{r.frozen_weight_share:.4f}",
             saved_bytes=r.saved_bytes, saved_bytes_per_sample=f"{r.per_sample:.0f}", ratio_vs_plain=f"{r.ratio:.3f}",
             step_ms="" if r.step_ms is None else f"{r.step_ms:.1f}", reps=r.reps, **common,
             **_measure.peak_columns(_measure.Result(peak=r.peak)))
        for r in rows], CSV_FIELDS)
    lines = ["# Saved activation bytes of patched models (CPU)", "",
             f"Written by `{_results.command('patch_memory', argv)}`.", ""]
    lines += [f"- {x}" for x in header_lines(args, load0, load1)]
    lines += ["", "## Bytes saved for backward per sample, and step time (forward + backward)", ""]
    lines += main_table(rows, md=True)
    lines += ["", "Ratios are against `plain` (unpatched, every parameter trainable, sdpa attention). Step peak: the "
              "total peak of one training step of the whole batch (weights, gradients, AdamW state, activations, "
              "temporaries; slimfit.step_memory), its parts at the peak in the CSV. `frozen` = "
              "layers frozen of the scheduler's candidate layers (ILSScheduler first step, seed 0: a seeded random "
              "90%); `frozen weights` = their share of the candidates' weights.",
              ""]
    lines += [f"**{x.strip()}**" if i == 0 else x.strip() for i, x in enumerate(target_lines(rows, args.quick))]
    lines += [""] + [f"- {x}" for x in _llama_lines(rows)]
    lines += ["", "## paper()+frozen for other seeded frozen sets (which 10% of the layers train)", ""]
    lines += seed_table(rows, md=True)
    for model in dict.fromkeys(r.model for r in rows):
        plain = next(r for r in rows if r.model == model and r.method == "plain")
        paper = next(r for r in rows if r.model == model and r.method == "paper+frozen" and r.frozen_seed == 0)
        lines += ["", f"## {model}: where the paper() bytes are (per role, all layers summed)", ""]
        lines += role_table(plain, paper, args.batch, md=True, top=args.top)
        lines += ["", ROLE_NOTE]
        lines += ["", f"Largest modules, paper()+frozen ({model}):", ""]
        lines += top_modules(paper, args.batch, md=True, top=args.top)
        s = summaries_by_model.get(model, {}).get("paper+frozen")
        if s is not None:
            lines += ["", "```", str(s), "```"]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    _results.write_text(md_path, "\n".join(lines) + "\n")
    return csv_path, md_path


ROLE_NOTE = ("A storage saved by several modules counts once, for the first module that saves it: the input "
             "that Q, K and V projections share is counted at `query`/`q_proj` in plain PyTorch, and at the "
             "first *trainable* projection after patching (hence rows with 0 in plain; `n/a` reduction).")

NOTES = [
    "Saved bytes are per sample at the batch above; they scale linearly with the batch (a few per-group "
    "scales aside) and with the sequence length, except attention probabilities (quadratic in the length).",
    "`plain+frozen`: PyTorch itself saves no input for a linear whose weight is frozen, so part of the "
    "saving is freezing alone; slimfit adds seed-regenerated dropout (exact), then compressed GELU input, "
    "Q/K/V, attention probabilities and frozen LayerNorm x̂ (paper), and 8-bit inputs of trainable linears "
    "and LayerNorms (aggressive).",
    "Presets as measured: exact() = frozen fast path + seed-regenerated dropout; paper() = exact() + GELU input "
    "4-bit, Q/K/V 8-bit, attention probabilities 8-bit, LayerNorm x̂ top-10% when its weight is frozen (full when "
    "trainable), FFN output projection input 8-bit; aggressive() = paper() + every trainable linear's input "
    "8-bit, LayerNorm x̂ 8-bit whether trainable or frozen.",
    "Which 10% of the layers train is drawn at random and moves the ratio only a little (seeded frozen sets "
    "above): what paper() keeps is mostly the compressed activations every layer saves whether frozen or not "
    "(Q/K/V + attention probabilities, GELU input, LayerNorm x̂), plus the full-precision inputs of the few "
    "trainable linears and LayerNorms.",
    "ViT-B/16 stays under 6x with paper() (5.06x with 8-bit P; 5.67x when paper() kept the top-10% of P, which "
    "turned pretrained ViT gradients, bench/results/grad_fidelity_cpu.md): without dropout, plain sdpa on the "
    "CPU saves Q, K, V and the output (no attention matrix), while slimfit's attention saves Q/K/V and P at 8 "
    "bits, so attention shrinks only ~2x; with 197 tokens the trainable projections' full-precision inputs also "
    "weigh more. A frozen patch-embedding conv saves nothing (PyTorch would keep the 0.57 MiB/sample of pixel "
    "values whenever the conv's bias trains).",
    "ViTConfig() has hidden and attention dropout 0.0 (the ViT fine-tuning default), so exact() saves nothing "
    "beyond freezing there; `--vit-dropout 0.1` measures a ViT with dropout. Without dropout, PyTorch's CPU sdpa "
    "uses its fused kernel (no attention matrix saved), hence plain-eager > plain for ViT; with dropout (BERT) "
    "sdpa falls back to the math path and saves the same as eager.",
    "Llama family (Llama-tiny, SmolLM-135M): paper() saves the SwiGLU product's gate and up at 4 bits (plain "
    "PyTorch keeps gate, silu(gate) and up in full) and RMSNorm x̂ top-10% when its weight is frozen, in full when "
    "trainable, plus rstd (plain keeps x twice and rstd). Before they were compressed, SmolLM-135M with paper() + "
    "90% frozen saved 1.50x fewer bytes than plain (`slimfit memory smollm-135m`, batch 1); now 3.68x.",
    "`(root)` is the loss: transformers' causal-LM loss runs cross_entropy on fp32 logits, whose log_softmax "
    "keeps tokens x vocabulary x 4 bytes (24 MiB per 128-token sample at SmolLM's 49,152-word vocabulary): half "
    "of what paper() keeps for SmolLM-135M, and no module slimfit patches. Without it the ratio is 6.1x (SmolLM) "
    "and 4.5x (Llama-tiny); a chunked / fused cross-entropy is the next lever.",
    "`wta_crs+frozen` = paper() + WTA-CRS sampled weight gradients (30% of the rows) for the attention-output and "
    "FFN linears: with 90% of the layers frozen only the few trainable targets keep inputs at all, so it moves "
    "the totals a little (BERT-base 8.55x -> 8.92x, SmolLM-135M 3.68x -> 3.80x); it matters when many linears "
    "train.",
    "Step times on a shared 2-core machine are noisy (load average above); compare rows of one run only. "
    "The CPU step time of the compressed presets includes quantize/top-k work that a GPU does far faster.",
]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="bert,vit,llama-tiny,smollm",
                    help="comma list of bert, vit, llama-tiny, smollm (default all four)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128, help="BERT sequence length (default 128)")
    ap.add_argument("--image-size", type=int, default=None, help="ViT image side (default 224)")
    ap.add_argument("--freeze-rate", type=float, default=0.9)
    ap.add_argument("--vit-dropout", type=float, default=None,
                    help="ViT hidden and attention dropout (default: ViTConfig's, 0.0)")
    ap.add_argument("--repeats", type=int, default=3, help="timed training steps per row (0: not timed)")
    ap.add_argument("--no-peak", action="store_true", help="no total step peak (saved bytes and time only)")
    ap.add_argument("--frozen-seeds", type=int, default=3,
                    help="paper() bytes for the frozen sets of seeds 0..N-1 (default 3)")
    ap.add_argument("--top", type=int, default=12, help="rows of the per-module tables")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--cpu-timer", choices=["wall", "process"], default="wall")
    ap.add_argument("--quick", action="store_true", help="2-layer models, seq 64, one timed run, writes nothing")
    ap.add_argument("--out-dir", default=None,
                    help="where to write patch_memory_cpu.{csv,md} (default bench/results; --quick writes nothing "
                         "unless given)")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    # wta_crs+frozen runs without sample ids on purpose (the saved bytes do not depend on them)
    warnings.filterwarnings("ignore", message=r"slimfit: sampling \(SlimFitConfig.sampling\) runs without sample ids")
    if args.quick:
        args.seq_len = min(args.seq_len, 64)
        args.repeats = min(args.repeats, 1)
        args.frozen_seeds = min(args.frozen_seeds, 2)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = _timing.Settings(cpu_warmup=0, cpu_min_reps=max(1, args.repeats), cpu_min_time_s=0.0,
                                cpu_max_reps=max(1, args.repeats), cpu_max_time_s=float("inf"),
                                cpu_slow_min_reps=max(1, args.repeats), cpu_clock=args.cpu_timer)
    load0 = _results.load_average()
    for line in header_lines(args, load0, "(running)"):
        print(line)

    rows: list[Row] = []
    summaries = {}
    for label, arch in model_specs(args):
        r, s = bench_model(label, arch, args, settings)
        rows += r
        summaries[label] = s
    load1 = _results.load_average()

    print()
    print("\n".join(main_table(rows, md=False)))
    print()
    print("\n".join(seed_table(rows, md=False)))
    for model in dict.fromkeys(r.model for r in rows):
        plain = next(r for r in rows if r.model == model and r.method == "plain")
        paper = next(r for r in rows if r.model == model and r.method == "paper+frozen" and r.frozen_seed == 0)
        print(f"\n{model}: paper()+frozen vs plain per role (all layers summed)")
        print("\n".join(role_table(plain, paper, args.batch, md=False, top=args.top)))
        print(ROLE_NOTE)
        print(f"\n{model}: largest modules, paper()+frozen")
        print("\n".join(top_modules(paper, args.batch, md=False, top=args.top)))
    print()
    print("\n".join(target_lines(rows, args.quick)))
    print("\n".join(_llama_lines(rows)))

    if args.out_dir is not None or not args.quick:
        csv_path, md_path = write_results(args.out_dir, args, argv, rows, summaries, load0, load1, NOTES)
        print(f"\nwrote {csv_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
