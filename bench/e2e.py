#!/usr/bin/env python
"""End-to-end training steps: slimfit against what a user would pick instead.

    python -m bench.e2e                    # CPU: BERT-base seq 128 (batch 4) and ViT-B/16 224 (batch 2), fp32
                                           # (--dtypes fp32,bf16 adds bf16 autocast: very slow on CPUs without
                                           # bf16 units); writes bench/results/e2e_cpu.{csv,md,png}
    python -m bench.e2e --device cuda      # GPU: batch 128, fp32 and bf16 autocast; writes bench/results/e2e_gpu.*
    python -m bench.e2e --quick            # 2-layer models, batch 2, seq 32, one timed step: writes nothing
    python -m bench.e2e --plot bench/results/e2e_gpu.csv   # (re)draw the PNG of a CSV (e.g. made where
                                                            # matplotlib is missing)
    python -m bench.e2e --render-only      # rebuild e2e_cpu.md from e2e_cpu.csv (new columns: '-' where not measured)

Models: `BertForSequenceClassification(BertConfig())` (BERT-base) and `ViTForImageClassification(ViTConfig())`
(ViT-B/16), random weights (memory and time do not depend on their values), train mode, dropout on,
AdamW over the trainable parameters. One training step = forward, backward, optimizer step,
zero_grad (+ scheduler step for the slimfit rows).

Methods (a fresh model for each):
  eager              plain PyTorch, attention written out (softmax(QK^T) materialised)
  sdpa               plain PyTorch, torch's scaled_dot_product_attention (the transformers default)
  grad-ckpt          sdpa + gradient checkpointing of every layer (use_reentrant=False)
  lora-r8            PEFT LoRA r=8 on query/value, classifier trains, base frozen
  slimfit-exact      slimfit.patch(exact()) + ILSScheduler(freeze_rate=0.9)
  slimfit-paper      slimfit.patch(paper()) + ILSScheduler(freeze_rate=0.9)   (the SlimFit method)
  slimfit-aggressive slimfit.patch(aggressive()) + ILSScheduler(freeze_rate=0.9)
  slimfit-paper+lora LoRA r=8 as above, then slimfit.patch(paper()) (base frozen: no scheduler)
  slimfit-wta_crs    paper() + WTA-CRS (ratio 0.3 on attention output and FFN linears) + scheduler 0.9
                     (only when this slimfit's SlimFitConfig has `sampling`)

Measured per method (bench/_measure.py, the same on both devices): the saved activation bytes of one
forward + backward (slimfit.memory's saved-tensor hooks; parameters not counted; gradient checkpointing's kept
layer inputs are counted, its transient recomputation is not); the total peak of one whole step
(slimfit.step_memory: weights, gradients, AdamW state, activations and temporaries; GPU: the allocator's
max_memory_allocated over the step after 3 warm-up steps; CPU: tensor storages sampled after every op, AdamW
state made beforehand) with the bytes resident at its entry; the median step time (CPU: perf_counter;
GPU: triton's do_bench) and throughput = batch / step time. A method that runs out of memory is recorded as OOM.
`--render-only` rebuilds the Markdown (and PNG) of the results' CSV, keeping the Markdown's header.

Targets (GPU, BERT-base, seq 128, batch 128, fp32), printed, not asserted: slimfit-paper peak memory at
most 1/4 of plain sdpa's, step time no worse than sdpa's, throughput at least 1.3x that of grad-ckpt. Tables
compare with sdpa (what transformers runs by default), or with eager in a run without an sdpa row.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/e2e.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import contextlib
import dataclasses
import os
import sys
from dataclasses import asdict, dataclass

import torch

import slimfit
from bench import _measure, _results, _timing
from slimfit import architectures as archs
from slimfit.config import SlimFitConfig
from slimfit.training.finetune import quiet_transformers

MiB = 2 ** 20
FREEZE_RATE = 0.9
LORA_TARGETS = ["query", "value", "q_proj", "v_proj"]  # BERT names; ViT (transformers 5) names
SAMPLED_RATIO = 0.3


@dataclass(frozen=True)
class Method:
    attn: str = "sdpa"
    ckpt: bool = False
    lora: bool = False
    preset: str | None = None
    scheduler: bool = False
    sampling: bool = False


METHODS = {
    "eager": Method(attn="eager"),
    "sdpa": Method(),
    "grad-ckpt": Method(ckpt=True),
    "lora-r8": Method(lora=True),
    "slimfit-exact": Method(preset="exact", scheduler=True),
    "slimfit-paper": Method(preset="paper", scheduler=True),
    "slimfit-aggressive": Method(preset="aggressive", scheduler=True),
    "slimfit-paper+lora": Method(preset="paper", lora=True),
    "slimfit-wta_crs": Method(preset="paper", scheduler=True, sampling=True),
}


def sampling_available() -> bool:
    return any(f.name == "sampling" for f in SlimFitConfig.__dataclass_fields__.values())


@dataclass
class Row:
    device: str
    model: str
    method: str
    dtype: str
    batch: int
    shape: str
    status: str                  # ok / OOM / error text
    trainable_params: int = 0
    saved_mib: float | None = None       # saved activations of one step (saved-tensor hooks)
    peak_mib: float | None = None        # total peak of one step (slimfit.step_memory)
    static_mib: float | None = None      # resident at the step's entry (weights, optimizer state, batch)
    step_ms: float | None = None
    throughput: float | None = None      # samples / s
    reps: int = 0
    device_name: str = ""
    torch: str = ""
    triton: str = ""
    date: str = ""
    weights_mib: float | None = None     # the step peak's parts at the peak
    gradients_mib: float | None = None
    optimizer_mib: float | None = None
    peak_saved_mib: float | None = None
    transient_mib: float | None = None


FLOATS = ("saved_mib", "peak_mib", "static_mib", "step_ms", "throughput", "weights_mib", "gradients_mib",
          "optimizer_mib", "peak_saved_mib", "transient_mib")


# ------------------------------------------------------------------ building one method
def _architectures(args):
    out = []
    for key in args.models.split(","):
        key = key.strip().lower()
        if key in ("bert", "bert-base"):
            arch, label = archs.ARCHITECTURES["bert-base"], "BERT-base"
        elif key in ("vit", "vit-base"):
            arch, label = archs.ARCHITECTURES["vit-base"], "ViT-B/16"
        else:
            raise SystemExit(f"--models: unknown model {key!r} (bert, vit)")
        if args.quick:
            arch = dataclasses.replace(arch, name=arch.name + "-2l", config={**arch.config, "num_hidden_layers": 2},
                                       about=arch.about + " (2 layers)")
            label += " (2 layers)"
        out.append((label, arch))
    return out


def build_method(arch, method: Method, device: str):
    """(model to call, scheduler or None, optional per-step hook) for one method on a fresh model."""
    model = archs.build(arch, attn_implementation=method.attn, seed=0).to(device)
    if method.ckpt:
        model.config.use_cache = False
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if method.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=LORA_TARGETS,
                                                 modules_to_save=["classifier"]))
    on_step = None
    if method.preset is not None:
        config = SlimFitConfig.preset(method.preset)
        if method.sampling:
            config = config.with_sampling(method="wta_crs", ratio=SAMPLED_RATIO)
        slimfit.patch(model, config)
        if method.sampling:
            counter = iter(range(10 ** 9))

            def on_step(batch):
                # fresh ids every step, as from a data set larger than the run (no sample seen twice)
                start = next(counter) * batch
                return {"sample_ids": torch.arange(start, start + batch)}
    scheduler = None
    if method.scheduler:
        from slimfit.scheduler import ILSScheduler

        # the optimizer's state as AdamW makes it, said explicitly: the activation comparison stays the same
        # whatever the scheduler's default (bench/frontier.py has the 8-bit frozen state's whole step)
        scheduler = ILSScheduler(model, freeze_rate=FREEZE_RATE, seed=0, frozen_state=None, warmup_steps=0)
    return model, scheduler, on_step


@contextlib.contextmanager
def _method_setup(arch, method: Method, dtype: str, batch: int, args, device: str, row: Row):
    """A fresh model for the method, its batch, AdamW (over every parameter when a scheduler freezes,
    else over the trainable ones) and the scheduler's step after each step: a bench/_measure.py Setup."""
    model, scheduler, on_step = build_method(arch, method, device)
    inputs = archs.make_inputs(model, arch.task, batch, args.seq_len, None, seed=0, device=device)
    row.shape = (f"seq {args.seq_len}" if arch.task != archs.IMAGE_CLS
                 else "x".join(str(s) for s in inputs["pixel_values"].shape[-2:]))
    params = list(model.parameters()) if scheduler else [p for p in model.parameters() if p.requires_grad]
    row.trainable_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    if scheduler is not None:
        scheduler.attach_optimizer(optimizer)
    extra = (lambda: on_step(batch)) if on_step is not None else None
    try:
        yield _measure.Setup(model, inputs, dtype=dtype, optimizer=optimizer,
                             after_step=scheduler.step if scheduler is not None else None, extra=extra)
    finally:
        del model, optimizer, scheduler


def _what(args, device: str) -> _measure.What:
    if device.startswith("cuda"):
        timing = _timing.Settings(cuda_warmup_ms=1.0, cuda_rep_ms=float(args.cuda_rep_ms))
        return _measure.What(time=timing, warmup_steps=3)
    timing = _timing.Settings(cpu_warmup=0, cpu_min_reps=args.repeats, cpu_min_time_s=0.0,
                              cpu_max_reps=args.repeats, cpu_slow_min_reps=args.repeats)
    return _measure.What(time=timing)


def run_method(label, arch, name: str, method: Method, dtype: str, args, device: str) -> Row:
    batch = args.batch or (128 if device.startswith("cuda") else (4 if arch.task != archs.IMAGE_CLS else 2))
    versions = _results.versions()
    row = Row(device, label, name, dtype, batch, "", "ok", device_name=_results.device_name(device),
              torch=versions["torch"], triton=versions["triton"], date=_results.now())
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    case = _measure.Case(name, lambda: _method_setup(arch, method, dtype, batch, args, device, row))
    try:
        (_, result), = _measure.run([case], _what(args, device))
        _fill(row, result)
    except torch.cuda.OutOfMemoryError:
        row.status = "OOM"
    finally:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return row


def _fill(row: Row, result: _measure.Result) -> None:
    row.saved_mib, row.peak_mib, row.static_mib = result.mib("saved"), result.mib("peak"), result.mib("resident")
    for field, part in (("weights_mib", "weights"), ("gradients_mib", "gradients"),
                        ("optimizer_mib", "optimizer_state"), ("peak_saved_mib", "saved_at_peak"),
                        ("transient_mib", "transient")):
        setattr(row, field, result.mib(part))
    row.step_ms, row.reps = result.timing.ms, result.timing.reps
    row.throughput = row.batch / (row.step_ms / 1e3)


# ------------------------------------------------------------------ reporting
def _f(value, fmt):
    return "-" if value is None else format(value, fmt)


def _vs(value, base) -> str:
    return "-" if (value is None or not base) else f"{value / base:.2f}x"


def _parts(r: Row) -> str:
    parts = (r.weights_mib, r.gradients_mib, r.optimizer_mib, r.peak_saved_mib, r.transient_mib)
    return "-" if None in parts else " + ".join(f"{p:,.0f}" for p in parts)


def markdown(rows: list[Row], device: str) -> str:
    """One table per (model, dtype): saved activations and the total step peak beside them, step time."""
    lines = []
    for (model, dtype) in dict.fromkeys((r.model, r.dtype) for r in rows):
        group = [r for r in rows if r.model == model and r.dtype == dtype]
        base = _plain(group)
        vs = f"vs {base.method if base else 'sdpa'}"
        body = []
        for r in group:
            body.append([r.method, _f(r.saved_mib, ",.1f"), _vs(r.saved_mib, base and base.saved_mib),
                         _f(r.peak_mib, ",.1f"), _vs(r.peak_mib, base and base.peak_mib), _parts(r),
                         _f(r.static_mib, ",.1f"), _f(r.step_ms, ",.0f"), _vs(r.step_ms, base and base.step_ms),
                         _f(r.throughput, ".2f"), f"{r.trainable_params:,}", r.status])
        head = ["method", "saved activations MiB/step", vs, "step peak MiB", vs,
                "at the peak: weights + grads + AdamW + saved + transient MiB", "at entry MiB", "step ms",
                vs, "samples/s", "trainable params", "status"]
        lines += [f"### {model}, {group[0].shape}, batch {group[0].batch}, {dtype}", ""]
        lines += _results.md_table(head, body, right=range(1, 11)) + [""]
        if all(r.peak_mib is None for r in group):
            lines += ["Step peak: not measured in this run (the column is newer than it); "
                      "`python -m bench.e2e --merge` redoes rows.", ""]
    return "\n".join(lines)


def _plain(group: list[Row]) -> Row | None:
    """The row the others are compared with: plain sdpa, else plain eager (runs without an sdpa row)."""
    ok = {r.method: r for r in group if r.status == "ok"}
    return ok.get("sdpa") or ok.get("eager")


def targets(rows: list[Row]) -> list[str]:
    """The issue's GPU targets for BERT-base fp32, met or missed (GPU rows only)."""
    group = {r.method: r for r in rows if r.model.startswith("BERT-base") and r.dtype == "fp32" and r.status == "ok"
             and r.peak_mib is not None}
    e = _plain(list(group.values()))
    if e is None or not {"slimfit-paper", "grad-ckpt"} <= group.keys():
        return ["targets: need GPU rows of sdpa (or eager), grad-ckpt and slimfit-paper for BERT-base fp32"]
    p, c = group["slimfit-paper"], group["grad-ckpt"]
    checks = [(f"paper peak memory <= 1/4 of {e.method}", p.peak_mib / e.peak_mib, p.peak_mib <= e.peak_mib / 4,
               f"{p.peak_mib:,.0f} / {e.peak_mib:,.0f} MiB"),
              (f"paper step time <= {e.method}", p.step_ms / e.step_ms, p.step_ms <= e.step_ms,
               f"{p.step_ms:.1f} / {e.step_ms:.1f} ms"),
              ("paper throughput >= 1.3x grad-ckpt", p.throughput / c.throughput, p.throughput >= 1.3 * c.throughput,
               f"{p.throughput:.1f} / {c.throughput:.1f} samples/s")]
    return [f"target {name}: {ratio:.2f} ({detail}) -> {'met' if ok else 'MISSED'}"
            for name, ratio, ok, detail in checks]


def merge_rows(old: list[Row], new: list[Row]) -> list[Row]:
    """`old` with the rows that `new` redoes replaced in place; new (model, dtype, method) appended, then
    grouped by (model, dtype) in order of first appearance."""
    merged = _results.merge_rows(old, new, key=lambda r: (r.model, r.dtype, r.method))
    order = list(dict.fromkeys((r.model, r.dtype) for r in merged))
    return sorted(merged, key=lambda r: order.index((r.model, r.dtype)))


def write_csv(rows: list[Row], path: str) -> None:
    _results.write_rows(path, [asdict(r) for r in rows])


def read_csv(path: str) -> list[Row]:
    """The rows of a results CSV; columns newer than the file read as not measured."""
    rows = []
    for d in _results.read_rows(path):
        for k in FLOATS:
            d[k] = float(d[k]) if d.get(k) not in (None, "", "None") else None
        for k in ("batch", "trainable_params", "reps"):
            d[k] = int(d[k])
        rows.append(Row(**d))
    return rows


def plot(rows: list[Row], path: str) -> bool:
    """Memory against throughput, one point per method, one panel per (model, dtype)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: PNG not written (pip install matplotlib; then --plot CSV)")
        return False
    groups = list(dict.fromkeys((r.model, r.dtype) for r in rows))
    peak = all(r.peak_mib is not None for r in rows if r.status == "ok")  # else the saved bytes (older CSVs)
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.6), squeeze=False)
    for ax, (model, dtype) in zip(axes[0], groups):
        for r in rows:
            mem = r.peak_mib if peak else r.saved_mib
            if r.model != model or r.dtype != dtype or r.status != "ok" or mem is None:
                continue
            color = "tab:red" if r.method.startswith("slimfit") else "tab:blue"
            ax.scatter(r.throughput, mem / 1024 if peak else mem, color=color, s=36)
            ax.annotate(r.method, (r.throughput, mem / 1024 if peak else mem), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
        batch = next(r.batch for r in rows if r.model == model)
        ax.set_title(f"{model}, {dtype}, batch {batch}", fontsize=9)
        ax.set_xlabel("throughput (samples/s)")
        ax.set_ylabel("step peak memory (GiB)" if peak else "saved activations (MiB/step)")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    fig.suptitle(f"slimfit end-to-end, {rows[0].device_name}, torch {rows[0].torch} (lower right is better)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------ main
def _methods(spec: str) -> list[str]:
    methods = [m.strip() for m in spec.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"--methods: unknown method {m!r}; choose from {', '.join(METHODS)}")
    if "slimfit-wta_crs" in methods and not sampling_available():
        print("slimfit-wta_crs skipped: this slimfit's SlimFitConfig has no sampling")
        methods.remove("slimfit-wta_crs")
    return methods


def _header(rows: list[Row], device: str) -> str:
    v = _results.versions()
    gpu = device.startswith("cuda")
    memory = ("saved activation bytes of one step (saved-tensor hooks) and the total peak of one step "
              "(slimfit.step_memory: " + ("torch.cuda.max_memory_allocated over the step after 3 warm-up steps"
                                          if gpu else "tensor storages sampled after every op, AdamW state made "
                                          "beforehand") + "; its parts at the peak)")
    return (f"# End-to-end training step ({rows[0].device_name})\n\n"
            f"torch {v['torch']}, triton {v['triton']}, {_results.now()}, load average {_results.load_average()}; "
            f"`{_results.command('e2e', ['--device', 'cuda' if gpu else 'cpu'])}`. "
            f"Slimfit rows freeze with ILSScheduler(freeze_rate={FREEZE_RATE}). Memory: {memory}.\n\n")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--models", default="bert,vit")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--dtypes", default=None,
                   help="default fp32,bf16 on a GPU; fp32 on the CPU (bf16 autocast there took 168 s per BERT-base "
                        "step of batch 4 on the 2-core AMD EPYC here: no bf16 matrix units)")
    p.add_argument("--batch", type=int, default=None, help="default 128 on a GPU; 4 (BERT) / 2 (ViT) on the CPU")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed steps on the CPU")
    p.add_argument("--cuda-rep-ms", type=float, default=2000.0,
                   help="GPU: milliseconds of timed steps (do_bench's rep; at least one step)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out-dir", default=None, help="default bench/results (nothing is written with --quick)")
    p.add_argument("--quick", action="store_true", help="2-layer models, batch 2, seq 32, one timed step")
    p.add_argument("--plot", default=None, metavar="CSV", help="only draw the PNG of an existing CSV")
    p.add_argument("--render-only", action="store_true",
                   help="only rebuild the Markdown (header kept) and PNG of the results' CSV for --device")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of an existing CSV that this run does not redo (same model, dtype, method)")
    return p


def render_only(base: str, device: str) -> int:
    """Rebuild <base>.md from <base>.csv with this version's tables, keeping the Markdown's header (the run's
    date, machine and command), and redraw the PNG."""
    rows = read_csv(base + ".csv")
    old = open(base + ".md").read() if os.path.exists(base + ".md") else ""
    header = old[:old.index("### ")] if "### " in old else _header(rows, device)
    notes = targets(rows) if device.startswith("cuda") else []
    tail = "\n" + "\n".join(notes) + "\n" if notes else ""
    _results.write_text(base + ".md", header + markdown(rows, device) + tail)
    plot(rows, base + ".png")
    print(f"rewrote {base}.md, .png")
    return 0


def measure_all(args, device: str, methods: list[str], on_row) -> list[Row]:
    """Every (model, dtype, method) of the arguments, in order; on_row(rows so far) after each."""
    rows: list[Row] = []
    for label, arch in _architectures(args):
        if arch.task == archs.IMAGE_CLS and args.quick:
            arch = dataclasses.replace(arch, config={**arch.config, "image_size": 64})
        for dtype in args.dtypes.split(","):
            print(f"\n== {label}, {dtype}, {device}", flush=True)
            for name in methods:
                r = run_method(label, arch, name, METHODS[name], dtype, args, device)
                rows.append(r)
                print(f"  {name:<20} {r.status:<4} saved {_f(r.saved_mib, '8.1f')} MiB  step peak "
                      f"{_f(r.peak_mib, '9,.0f')} MiB  step {_f(r.step_ms, '8,.0f')} ms  "
                      f"{_f(r.throughput, '8.2f')} samples/s", flush=True)
                on_row(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = args.device
    if args.plot:
        return 0 if plot(read_csv(args.plot), os.path.splitext(args.plot)[0] + ".png") else 1
    if args.render_only:
        return render_only(_results.results_path("e2e", "", device, args.out_dir), device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.batch, args.seq_len, args.repeats = args.batch or 2, 32, 1
    if args.dtypes is None:
        args.dtypes = "fp32,bf16" if device.startswith("cuda") else "fp32"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    methods = _methods(args.methods)
    quiet_transformers()

    write = args.out_dir is not None or not args.quick
    base = _results.results_path("e2e", "", device, args.out_dir) if write else None
    previous = read_csv(base + ".csv") if (base and args.merge and os.path.exists(base + ".csv")) else []
    # after every row: an interrupted run keeps what it measured
    rows = measure_all(args, device, methods, lambda rows: base and write_csv(merge_rows(previous, rows),
                                                                               base + ".csv"))
    all_rows = merge_rows(previous, rows)
    text = markdown(all_rows, device)
    print("\n" + text)
    notes = targets(all_rows) if device.startswith("cuda") else []
    for line in notes:
        print(line)
    if base:
        _results.write_text(base + ".md", _header(all_rows, device) + text
                            + ("\n" + "\n".join(notes) + "\n" if notes else ""))
        plot(all_rows, base + ".png")
        print(f"wrote {base}.csv, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
