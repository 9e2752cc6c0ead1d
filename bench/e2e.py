#!/usr/bin/env python
"""End-to-end training steps: slimfit against what a user would pick instead.

    python -m bench.e2e                    # CPU: BERT-base seq 128 (batch 4) and ViT-B/16 224 (batch 2), fp32
                                           # (--dtypes fp32,bf16 adds bf16 autocast: very slow on CPUs without
                                           # bf16 units); writes bench/results/e2e_cpu.{csv,md,png}
    python -m bench.e2e --device cuda      # GPU: batch 128, fp32 and bf16 autocast; writes bench/results/e2e_gpu.*
    python -m bench.e2e --quick            # 2-layer models, batch 2, seq 32, one timed step: writes nothing
    python -m bench.e2e --plot bench/results/e2e_gpu.csv   # (re)draw the PNG of a CSV (e.g. made where
                                                            # matplotlib is missing)

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

GPU: peak memory = torch.cuda.max_memory_allocated over the timed steps (weights, gradients, AdamW state
and activations: the total a user must fit), after 3 warm-up steps; step time = median of CUDA-event
timed steps; throughput = batch / step time. A method that runs out of memory is recorded as OOM.
CPU: saved activation bytes of one step (slimfit.memory's saved-tensor hooks; parameters not counted;
gradient checkpointing's kept layer inputs are counted, its transient recomputation is not) and the
median step time (perf_counter) after one warm-up step.

Targets (GPU, BERT-base, seq 128, batch 128, fp32), printed, not asserted: slimfit-paper peak memory at
most 1/4 of eager, step time no worse than eager, throughput at least 1.3x that of grad-ckpt.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/e2e.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

import slimfit
from bench import _results
from slimfit import architectures as archs
from slimfit.config import SlimFitConfig
from slimfit.demo.finetune import quiet_transformers

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
    saved_mib: float | None = None       # CPU: saved activations of one step
    peak_mib: float | None = None        # GPU: max_memory_allocated over the timed steps
    static_mib: float | None = None      # GPU: allocated before a step (weights, grads, optimizer state)
    step_ms: float | None = None
    throughput: float | None = None      # samples / s
    reps: int = 0
    device_name: str = ""
    torch: str = ""
    triton: str = ""
    date: str = ""


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

        scheduler = ILSScheduler(model, freeze_rate=FREEZE_RATE, seed=0)
    return model, scheduler, on_step


def _autocast(dtype: str, device: str):
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def run_method(label, arch, name: str, method: Method, dtype: str, args, device: str) -> Row:
    batch = args.batch or (128 if device.startswith("cuda") else (4 if arch.task != archs.IMAGE_CLS else 2))
    versions = _results.versions()
    row = Row(device, label, name, dtype, batch, "", "ok", device_name=_results.device_name(device),
              torch=versions["torch"], triton=versions["triton"], date=_results.now())
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        model, scheduler, on_step = build_method(arch, method, device)
        inputs = archs.make_inputs(model, arch.task, batch, args.seq_len, None, seed=0, device=device)
        row.shape = (f"seq {args.seq_len}" if arch.task != archs.IMAGE_CLS
                     else "x".join(str(s) for s in inputs["pixel_values"].shape[-2:]))
        params = list(model.parameters()) if scheduler else [p for p in model.parameters() if p.requires_grad]
        row.trainable_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        optimizer = torch.optim.AdamW(params, lr=1e-5)
        if scheduler is not None:
            scheduler.attach_optimizer(optimizer)

        def step():
            extra = on_step(batch) if on_step is not None else {}
            with _autocast(dtype, device):
                loss = model(**inputs, **extra).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()

        if device.startswith("cuda"):
            _measure_cuda(step, row, args)
        else:
            _measure_cpu(model, inputs, step, row, dtype, on_step, args)
    except torch.cuda.OutOfMemoryError:
        row.status = "OOM"
    finally:
        model = optimizer = scheduler = None  # noqa: F841  (free before the next method)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return row


def _measure_cpu(model, inputs, step, row: Row, dtype: str, on_step, args) -> None:
    extra = on_step(row.batch) if on_step is not None else {}
    run = archs.measure_step(model, {**inputs, **extra}, dtype=dtype, seed=0, name=row.method)
    row.saved_mib = run.total / MiB
    step()  # warm-up (also the first optimizer step: AdamW state allocated)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    row.step_ms = 1e3 * statistics.median(times)
    row.throughput = row.batch / (row.step_ms / 1e3)
    row.reps = len(times)


def _measure_cuda(step, row: Row, args) -> None:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    row.static_mib = torch.cuda.memory_allocated() / MiB
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(max(args.repeats, 5)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    row.peak_mib = torch.cuda.max_memory_allocated() / MiB
    row.step_ms = statistics.median(times)
    row.throughput = row.batch / (row.step_ms / 1e3)
    row.reps = len(times)


# ------------------------------------------------------------------ reporting
def _f(value, fmt):
    return "-" if value is None else format(value, fmt)


def markdown(rows: list[Row], device: str) -> str:
    gpu = device.startswith("cuda")
    mem_head = "peak MiB" if gpu else "saved activations MiB/step"
    lines = []
    for (model, dtype) in dict.fromkeys((r.model, r.dtype) for r in rows):
        group = [r for r in rows if r.model == model and r.dtype == dtype]
        base = next((r for r in group if r.method == "eager" and r.status == "ok"), None)
        body = []
        for r in group:
            mem = r.peak_mib if gpu else r.saved_mib
            bmem = None if base is None else (base.peak_mib if gpu else base.saved_mib)
            ratio = "-" if (mem is None or not bmem) else f"{mem / bmem:.2f}x"
            tratio = "-" if (r.step_ms is None or base is None) else f"{r.step_ms / base.step_ms:.2f}x"
            body.append([r.method, _f(mem, ",.1f"), ratio, _f(r.step_ms, ",.0f"), tratio, _f(r.throughput, ".2f"),
                         f"{r.trainable_params:,}", r.status])
        head = ["method", mem_head, "vs eager", "step ms", "vs eager", "samples/s", "trainable params", "status"]
        lines += [f"### {model}, {group[0].shape}, batch {group[0].batch}, {dtype}", ""]
        lines += _results.md_table(head, body, right=range(1, 7)) + [""]
    return "\n".join(lines)


def targets(rows: list[Row]) -> list[str]:
    """The issue's GPU targets for BERT-base fp32, met or missed (GPU rows only)."""
    group = {r.method: r for r in rows if r.model.startswith("BERT-base") and r.dtype == "fp32" and r.status == "ok"
             and r.peak_mib is not None}
    if not {"eager", "slimfit-paper", "grad-ckpt"} <= group.keys():
        return ["targets: need GPU rows of eager, grad-ckpt and slimfit-paper for BERT-base fp32"]
    e, p, c = group["eager"], group["slimfit-paper"], group["grad-ckpt"]
    checks = [("paper peak memory <= 1/4 of eager", p.peak_mib / e.peak_mib, p.peak_mib <= e.peak_mib / 4,
               f"{p.peak_mib:,.0f} / {e.peak_mib:,.0f} MiB"),
              ("paper step time <= eager", p.step_ms / e.step_ms, p.step_ms <= e.step_ms,
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
    rows = []
    for d in _results.read_rows(path):
        for k in ("saved_mib", "peak_mib", "static_mib", "step_ms", "throughput"):
            d[k] = float(d[k]) if d[k] not in ("", "None") else None
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
    gpu = rows[0].device.startswith("cuda")
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.6), squeeze=False)
    for ax, (model, dtype) in zip(axes[0], groups):
        for r in rows:
            mem = r.peak_mib if gpu else r.saved_mib
            if r.model != model or r.dtype != dtype or r.status != "ok" or mem is None:
                continue
            color = "tab:red" if r.method.startswith("slimfit") else "tab:blue"
            ax.scatter(r.throughput, mem / 1024 if gpu else mem, color=color, s=36)
            ax.annotate(r.method, (r.throughput, mem / 1024 if gpu else mem), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
        batch = next(r.batch for r in rows if r.model == model)
        ax.set_title(f"{model}, {dtype}, batch {batch}", fontsize=9)
        ax.set_xlabel("throughput (samples/s)")
        ax.set_ylabel("peak memory (GiB)" if gpu else "saved activations (MiB/step)")
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
    memory = ("torch.cuda.max_memory_allocated (total)" if gpu else
              "saved activation bytes of one step (saved-tensor hooks)")
    return (f"# End-to-end training step ({rows[0].device_name})\n\n"
            f"torch {v['torch']}, triton {v['triton']}, {_results.now()}, load average {_results.load_average()}; "
            f"`{_results.command('e2e', ['--device', 'cuda' if gpu else 'cpu'])}`. "
            f"Slimfit rows freeze with ILSScheduler(freeze_rate={FREEZE_RATE}). Memory: {memory}.\n\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--models", default="bert,vit")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--dtypes", default=None,
                   help="default fp32,bf16 on a GPU; fp32 on the CPU (bf16 autocast there took 168 s per BERT-base "
                        "step of batch 4 on the 2-core AMD EPYC here: no bf16 matrix units)")
    p.add_argument("--batch", type=int, default=None, help="default 128 on a GPU; 4 (BERT) / 2 (ViT) on the CPU")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed steps (GPU: at least 5)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out-dir", default=None, help="default bench/results (nothing is written with --quick)")
    p.add_argument("--quick", action="store_true", help="2-layer models, batch 2, seq 32, one timed step")
    p.add_argument("--plot", default=None, metavar="CSV", help="only draw the PNG of an existing CSV")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of an existing CSV that this run does not redo (same model, dtype, method)")
    args = p.parse_args(argv)
    if args.plot:
        rows = read_csv(args.plot)
        png = os.path.splitext(args.plot)[0] + ".png"
        return 0 if plot(rows, png) else 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.batch, args.seq_len, args.repeats = args.batch or 2, 32, 1
    device = args.device
    if args.dtypes is None:
        args.dtypes = "fp32,bf16" if device.startswith("cuda") else "fp32"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    methods = _methods(args.methods)
    quiet_transformers()

    write = args.out_dir is not None or not args.quick
    base = _results.results_path("e2e", "", device, args.out_dir) if write else None
    previous = read_csv(base + ".csv") if (base and args.merge and os.path.exists(base + ".csv")) else []
    rows: list[Row] = []
    for label, arch in _architectures(args):
        if arch.task == archs.IMAGE_CLS and args.quick:
            arch = dataclasses.replace(arch, config={**arch.config, "image_size": 64})
        for dtype in args.dtypes.split(","):
            print(f"\n== {label}, {dtype}, {device}", flush=True)
            for name in methods:
                r = run_method(label, arch, name, METHODS[name], dtype, args, device)
                rows.append(r)
                mem = (f"peak {r.peak_mib:9,.0f} MiB" if r.peak_mib is not None else
                       f"saved {r.saved_mib:8.1f} MiB" if r.saved_mib is not None else "")
                print(f"  {name:<20} {r.status:<4} {mem}  step {_f(r.step_ms, '8,.0f')} ms  "
                      f"{_f(r.throughput, '8.2f')} samples/s", flush=True)
                if base:  # after every row: an interrupted run keeps what it measured
                    write_csv(merge_rows(previous, rows), base + ".csv")
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
