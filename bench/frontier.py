#!/usr/bin/env python
"""The memory/time frontier: the total step peak against the step time of slimfit and of what a user would
run instead, measured in one run, one table per model and shape.

    python -m bench.frontier                       # CPU: BERT-base batch 16 seq 128, SmolLM2-135M-shaped batch 1
                                                   # seq 2048; appends to bench/results/frontier_cpu.csv (resumable:
                                                   # rows already there are skipped), rewrites .md and .png
    python -m bench.frontier --cases bert-64,smollm2-8192
    python -m bench.frontier --quick               # 2-layer models, tiny shapes, every method: writes nothing
    python -m bench.frontier --render-only         # the Markdown and PNG again from the CSV
    python -m bench.frontier --cases bert-16 --methods sdpa,slimfit-paper+q8 --force   # measured again

Methods (a fresh model each; random weights; AdamW unless named; lr 0 so every row sees the same weights):
  sdpa                  full fine-tuning, PyTorch's SDPA attention (the transformers default)
  grad-ckpt             sdpa + gradient checkpointing of every layer (use_reentrant=False)
  lora-r8               PEFT LoRA r=8 on the attention query/value projections, base frozen
  lora-r8+ckpt          LoRA r=8 + gradient checkpointing (the usual LLM recipe)
  adamw8bit-torchao     full fine-tuning with torchao's AdamW8bit (block-wise 8-bit moments)
  adamw8bit-bnb         full fine-tuning with bitsandbytes' AdamW8bit
  badam                 BAdam's BlockOptimizer: one transformer block trains at a time (state for it only)
  recipe                the full fine-tuning recipe people run (torchtune's stack): gradient checkpointing +
                        bitsandbytes' 8-bit AdamW stepped inside backward (slimfit.optim.step_in_backward over
                        it: each gradient freed after its parameter's step) + chunked CE (a causal LM's loss
                        through slimfit's chunked linear + cross-entropy, nothing else patched)
  cce                   (decoders) Apple's cut-cross-entropy for the LM head (impl torch_compile on the CPU)
  slimfit-exact / -paper / -aggressive   slimfit.patch(preset) + ILSScheduler at its default rate (0.7),
                        AdamW over every parameter, frozen_state=None (a frozen layer keeps the state it made
                        when it trained, in full)
  slimfit-paper+lora    LoRA r=8, then slimfit.patch(paper())
  slimfit-paper+lora+ckpt  the same with gradient checkpointing
  slimfit-paper+adamw8bit  paper() + scheduler with torchao's AdamW8bit
  slimfit-paper+q8      paper() + scheduler, the frozen layers' AdamW state held 8-bit (slimfit.optim,
                        frozen_state="compress")
  slimfit-exact+q8 / slimfit-aggressive+q8   the same with exact() / aggressive()
  slimfit-paper+q8+inbwd   the same with each parameter's AdamW step taken in backward (step_in_backward)
  slimfit-paper+q8all+inbwd  and the trained layers' state held 8-bit too, between their own steps
  slimfit-paper+q8all+inbwd+ckpt  the same with gradient checkpointing: the recipe's stack with slimfit's
                        scheduler and compression
  slimfit-paper+q8all+noemb  slimfit-paper+q8all with the input embedding (and a tied head) held frozen for the run
                        (ILSScheduler(embeddings="freeze"): no gradient, no state for it)
  slimfit-paper+q8all / slimfit-aggressive+q8all   every layer's AdamW state 8-bit in a plain loop (the scheduler's
                        frozen_state="compress_all": the chunked step decodes, updates and encodes the moments a
                        piece at a time); slimfit-paper+q8all is the scheduler's default (frozen_state="auto")
  slimfit-paper+offload paper() + scheduler, the frozen layers' AdamW state in host memory (pinned on CUDA,
                        copied back on a side stream; on a CPU it saves nothing)
Liger-Kernel's fused linear cross-entropy needs a GPU (its Triton kernels find no CPU driver): not a CPU row.
A peer that cannot run here is a row with its error.

Measured per row (bench/_measure.py): the total step peak of one whole step (slimfit.step_memory; optimizer
state made beforehand, as in every step after the first), its parts, and the median step time. The frontier
check: for every peer row, the slimfit rows with no more peak and no more step time; where none exists the
table says so.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/frontier.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import contextlib
import dataclasses
import os
import sys
import types

import torch

from bench import _measure, _results, _timing
from slimfit import architectures as archs

MiB = 2 ** 20
LORA_TARGETS = ["query", "value", "q_proj", "v_proj"]
CASES = {  # name -> (architecture, batch, seq)
    "bert-16": ("bert-base", 16, 128), "bert-64": ("bert-base", 64, 128),
    "smollm2-2048": ("smollm2-135m", 1, 2048), "smollm2-8192": ("smollm2-135m", 1, 8192),
    "bert-128": ("bert-base", 128, 128),  # the GPU shape
    "qwen0.5b-1024": ("qwen2.5-0.5b", 1, 1024),   # a real LLM's shape: 494M parameters, a 152k vocabulary
}
DEFAULT_CASES = "bert-16,smollm2-2048"
FIELDS = ["case", "model", "batch", "seq", "method", "status", "step_peak_mib", "resident_mib", "weights_mib",
          "gradients_mib", "optimizer_mib", "saved_mib", "transient_mib", "step_s", "reps", "device_name", "torch",
          "date", "commit", "dtype"]


@dataclasses.dataclass(frozen=True)
class Method:
    ckpt: bool = False
    lora: bool = False
    optimizer: str = "adamw"      # adamw | torchao8 | bnb8 | badam
    preset: str | None = None     # slimfit preset, with the scheduler unless lora
    cce: bool = False
    decoder_only: bool = False
    frozen_state: str | None = None  # slimfit.optim.attach_frozen_state mode (with the scheduler)
    in_backward: bool = False        # slimfit.optim.step_in_backward: each parameter's step in backward
    between_steps: bool = False      # FrozenState(between_steps=True): the trained layers' state held too
    chunked_ce: bool = False         # a causal LM's loss through slimfit's chunked linear + cross-entropy alone
    held_table: bool = False         # the scheduler's embeddings="freeze": the input embedding (tied head) held frozen

    @property
    def slimfit(self) -> bool:
        return self.preset is not None


METHODS = {
    "sdpa": Method(), "grad-ckpt": Method(ckpt=True), "lora-r8": Method(lora=True),
    "lora-r8+ckpt": Method(lora=True, ckpt=True), "adamw8bit-torchao": Method(optimizer="torchao8"),
    "adamw8bit-bnb": Method(optimizer="bnb8"), "badam": Method(optimizer="badam"),
    "cce": Method(cce=True, decoder_only=True),
    "slimfit-exact": Method(preset="exact"), "slimfit-paper": Method(preset="paper"),
    "slimfit-aggressive": Method(preset="aggressive"), "slimfit-paper+lora": Method(preset="paper", lora=True),
    "slimfit-paper+lora+ckpt": Method(preset="paper", lora=True, ckpt=True),
    "slimfit-paper+adamw8bit": Method(preset="paper", optimizer="torchao8"),
    "slimfit-paper+q8": Method(preset="paper", frozen_state="compress"),
    "slimfit-exact+q8": Method(preset="exact", frozen_state="compress"),
    "slimfit-aggressive+q8": Method(preset="aggressive", frozen_state="compress"),
    "slimfit-paper+q8+inbwd": Method(preset="paper", frozen_state="compress", in_backward=True),
    "slimfit-paper+q8all+inbwd": Method(preset="paper", frozen_state="compress", in_backward=True,
                                        between_steps=True),
    "slimfit-paper+q8all+inbwd+ckpt": Method(preset="paper", frozen_state="compress", in_backward=True,
                                             between_steps=True, ckpt=True),
    "slimfit-paper+q8all": Method(preset="paper", frozen_state="compress", between_steps=True),
    "slimfit-paper+q8all+noemb": Method(preset="paper", frozen_state="compress", between_steps=True,
                                        held_table=True),
    "slimfit-aggressive+q8all": Method(preset="aggressive", frozen_state="compress", between_steps=True),
    "slimfit-paper+offload": Method(preset="paper", frozen_state="offload"),
    "recipe": Method(ckpt=True, optimizer="bnb8", in_backward=True, chunked_ce=True),
}


# ------------------------------------------------------------------ one method's model and optimizer
def _checkpointing(model) -> None:
    model.config.use_cache = False
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _lora(model, arch):
    from peft import LoraConfig, get_peft_model

    head = ["classifier"] if arch.task != archs.CAUSAL_LM else None
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                            modules_to_save=head))


def _optimizer(method: Method, model, params):
    if method.in_backward:
        from slimfit.optim import step_in_backward

        if method.optimizer == "bnb8":
            import bitsandbytes as bnb

            return step_in_backward(model, bnb.optim.AdamW8bit, lr=0.0)
        return step_in_backward(model, torch.optim.AdamW, lr=0.0)
    if method.optimizer == "torchao8":
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, lr=0.0)
    if method.optimizer == "bnb8":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=0.0)
    if method.optimizer == "badam":
        from badam import BlockOptimizer

        base = torch.optim.AdamW(params, lr=0.0)
        return BlockOptimizer(base_optimizer=base, named_parameters_list=list(model.named_parameters()),
                              block_prefix_list=_blocks(model), switch_block_every=50, switch_mode="ascending",
                              verbose=0)
    return torch.optim.AdamW(params, lr=0.0)


def _hold_frozen_state(setup, scheduler, mode: str, between_steps: bool) -> None:
    """slimfit.optim's FrozenState on the setup's optimizer, and one step so that it holds what it holds in
    every later step: every layer's AdamW state made first (a layer frozen now trained earlier), then the
    scheduler's step holds the frozen layers' state (the measured step finds it held)."""
    from slimfit.optim import attach_frozen_state
    from slimfit.optim.attach import state_code_options

    # the moments coded as the scheduler's own holder codes them
    attach_frozen_state(scheduler, setup.optimizer, mode=mode, between_steps=between_steps,
                        **state_code_options(scheduler.config.state_code))
    archs.prime_optimizer(setup.optimizer)
    setup.step()


def _blocks(model) -> list:
    """BAdam's blocks: the transformer layers, one prefix each (the first nn.ModuleList of 2+ modules)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1:
            return [[f"{name}.{i}."] for i in range(len(module))]
    raise ValueError("BAdam: no nn.ModuleList of layers in this model")


class _CutCrossEntropy(torch.nn.Module):
    """A causal LM whose loss is cut-cross-entropy's linear + cross-entropy on the last hidden states."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.config = lm.config

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        from cut_cross_entropy import linear_cross_entropy

        hidden = self.lm.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        head = self.lm.get_output_embeddings()
        loss = linear_cross_entropy(hidden[:, :-1], head.weight, labels[:, 1:], impl="torch_compile")
        return types.SimpleNamespace(loss=loss)


@contextlib.contextmanager
def method_setup(arch, method: Method, batch: int, seq: int, device: str = "cpu", dtype: str = "fp32"):
    """A _measure.Setup of one method on a fresh model: built, wrapped, patched, with its optimizer and the
    scheduler's step, on `device`, under `dtype` autocast."""
    import slimfit
    from slimfit.config import SlimFitConfig

    model = archs.build(arch, attn_implementation="sdpa", seed=0).to(device)
    inputs = archs.make_inputs(model, arch.task, batch, seq, None, seed=0, device=device)
    if method.ckpt:
        _checkpointing(model)
    if method.lora:
        model = _lora(model, arch)
    if method.cce:
        model = _CutCrossEntropy(model)
    if method.chunked_ce and arch.task == archs.CAUSAL_LM:   # torchtune's chunked CE: no other patch
        slimfit.patch(model, SlimFitConfig(dropout="torch", lm_head_chunk_rows=256))
    scheduler = None
    if method.slimfit:
        slimfit.patch(model, SlimFitConfig.preset(method.preset))
        if not method.lora:
            from slimfit.scheduler import ILSScheduler

            # the state as the method names it (slimfit-<preset>: in full; +q8: the frozen layers' 8-bit;
            # +q8all: every layer's 8-bit, the scheduler's default), attached by hand below
            # warmup_steps=0: the frozen set at the rate, the steady state (a causal LM's ramp: docs/fidelity.md)
            scheduler = ILSScheduler(model, seed=0, frozen_state=None, warmup_steps=0,
                                     embeddings="freeze" if method.held_table else "train")
    # under a scheduler every parameter but a table it holds frozen (held_table: it never gets a gradient, so a run
    # makes no state for it; the measurement's priming step would)
    held = {id(p) for _, p in scheduler.held_frozen} if scheduler else set()
    params = [p for p in model.parameters() if id(p) not in held] if scheduler else \
        [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(method, model, params)
    if scheduler is not None:
        scheduler.attach_optimizer(optimizer)
    setup = _measure.Setup(model, inputs, dtype=dtype, optimizer=optimizer,
                           after_step=scheduler.step if scheduler is not None else None)
    if method.frozen_state:
        _hold_frozen_state(setup, scheduler, method.frozen_state, method.between_steps)
    try:
        yield setup
    finally:
        del model, optimizer, scheduler


# ------------------------------------------------------------------ measuring and the table
def measure_row(case: str, method_name: str, args) -> dict:
    arch_name, batch, seq = args.case_shapes[case]
    arch = archs.resolve(arch_name)
    if args.quick:
        arch = dataclasses.replace(arch, config={**arch.config, "num_hidden_layers": 2})
    versions = _results.versions()
    row = {"case": case, "model": arch.name, "batch": batch, "seq": seq, "method": method_name, "status": "ok",
           "device_name": _results.device_name(args.device), "torch": versions["torch"], "date": _results.now(),
           "commit": _results.commit_label(), "dtype": args.dtype}
    gpu = args.device.startswith("cuda")
    settings = _timing.Settings(cpu_warmup=0, cpu_min_reps=args.repeats, cpu_min_time_s=0.0,
                                cpu_max_reps=args.repeats, cpu_slow_min_reps=args.repeats,
                                cuda_warmup_ms=1.0, cuda_rep_ms=args.cuda_rep_ms)
    what = _measure.What(saved=False, time=settings, warmup_steps=3 if gpu else 0)  # GPU: cuBLAS, allocator
    case_ = _measure.Case(method_name, lambda: method_setup(arch, METHODS[method_name], batch, seq, args.device,
                                                            args.dtype))
    if gpu:
        torch.cuda.empty_cache()
    try:
        (_, result), = _measure.run([case_], what)
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is a row saying why
        if not _compiled_inside(exc):
            row["status"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            return row
        # torch.compile inside the step stops under the CPU tracker's dispatch mode: time only
        row["status"] = "step peak not measurable on the CPU (torch.compile inside the step); time only"
        torch._dynamo.reset()  # the failed attempt under the tracker marked its frames as skipped
        (_, result), = _measure.run([case_], dataclasses.replace(what, peak=False))
        row["step_s"], row["reps"] = round(result.timing.ms / 1e3, 3), result.timing.reps
        return row
    for field, part in (("step_peak_mib", "peak"), ("resident_mib", "resident"), ("weights_mib", "weights"),
                        ("gradients_mib", "gradients"), ("optimizer_mib", "optimizer_state"),
                        ("saved_mib", "saved_at_peak"), ("transient_mib", "transient")):
        row[field] = round(result.mib(part), 2)
    row["step_s"], row["reps"] = round(result.timing.ms / 1e3, 3), result.timing.reps
    return row


def _compiled_inside(exc: Exception) -> bool:
    return "torch.compile" in str(exc) or type(exc).__module__.startswith("torch._dynamo")


def _num(row: dict, field: str) -> float | None:
    try:
        return float(row[field])
    except (KeyError, TypeError, ValueError):
        return None


def latest(rows: list[dict]) -> list[dict]:
    """Each (case, method, dtype)'s last row (a row measured again with --force replaces the older one)."""
    last = {(r["case"], r["method"], r.get("dtype") or "fp32"): r for r in rows}
    return list(last.values())


def dominating(peer: dict, rows: list[dict]) -> list[dict]:
    """The slimfit rows of the peer's case with no more step peak and no more step time than the peer."""
    peak, time = _num(peer, "step_peak_mib"), _num(peer, "step_s")
    if peak is None or time is None:
        return []
    return [r for r in rows if r["case"] == peer["case"] and (r.get("dtype") or "fp32") == (peer.get("dtype") or "fp32")
            and r["method"].startswith("slimfit")
            and _num(r, "step_peak_mib") is not None and _num(r, "step_peak_mib") <= peak
            and _num(r, "step_s") <= time]


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, ""]
    for case, dtype in dict.fromkeys((r["case"], r.get("dtype") or "fp32") for r in rows):
        mine = [r for r in rows if r["case"] == case and (r.get("dtype") or "fp32") == dtype]
        base = next((r for r in mine if r["method"] == "sdpa" and _num(r, "step_peak_mib")), None)
        first = mine[0]
        shown_dtype = "" if dtype == "fp32" else f", {dtype} autocast"
        lines += [f"## {first['model']}, batch {first['batch']}, seq {first['seq']}{shown_dtype}", ""]
        body = []
        for r in sorted(mine, key=lambda r: (_num(r, "step_peak_mib") is None, _num(r, "step_peak_mib") or 0)):
            peak, time = _num(r, "step_peak_mib"), _num(r, "step_s")
            if peak is None:
                shown = f"{time:.2f}" if time is not None else "-"
                body.append([r["method"], "-", "-", shown, "-", "-", r["status"]])
                continue
            vs = f"{_num(base, 'step_peak_mib') / peak:.2f}x" if base else "-"
            tvs = f"{time / _num(base, 'step_s'):.2f}x" if base else "-"
            beaten = "" if r["method"].startswith("slimfit") else (
                ", ".join(d["method"] for d in dominating(r, mine)) or "**none**")
            body.append([r["method"], f"{peak:,.0f}", vs, f"{time:.2f}", tvs, f"{_num(r, 'optimizer_mib'):,.0f}",
                         beaten])
        lines += _results.md_table(["method", "step peak MiB", "less than sdpa", "step s", "time vs sdpa",
                                    "optimizer MiB", "slimfit rows with no more peak and time"], body,
                                   right=range(1, 6))
        lines.append("")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = list(dict.fromkeys((r["case"], r.get("dtype") or "fp32") for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (case, dtype) in zip(axes[0], panels):
        for r in (r for r in rows if (r["case"], r.get("dtype") or "fp32") == (case, dtype)
                  and _num(r, "step_peak_mib")):
            mine = r["method"].startswith("slimfit")
            ax.scatter(_num(r, "step_s"), _num(r, "step_peak_mib"), marker="o" if mine else "x",
                       color="tab:blue" if mine else "tab:gray")
            ax.annotate(r["method"], (_num(r, "step_s"), _num(r, "step_peak_mib")), fontsize=7)
        ax.set_title(case if dtype == "fp32" else f"{case} {dtype}")
        ax.set_xlabel("step time (s)")
        ax.set_ylabel("total step peak (MiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------ command line
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of the methods above")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per row (median)")
    p.add_argument("--quick", action="store_true", help="2-layer models, batch 2, seq 32; writes nothing")
    p.add_argument("--render-only", action="store_true", help="the Markdown and PNG again from the CSV")
    p.add_argument("--force", action="store_true", help="measure the named rows again (a new row, the one shown)")
    p.add_argument("--out", default=None, help="results folder (default bench/results)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (results: frontier_cpu.* or frontier_gpu.*)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="fp32, or bf16 autocast")
    p.add_argument("--cuda-rep-ms", type=float, default=1000.0, help="GPU: milliseconds of timed steps per row")
    return p


def _header(args, rows: list[dict]) -> str:
    tag = _results.device_tag(args.device)
    name = rows[0]["device_name"] if rows else _results.device_name(args.device)
    runs = sorted({r["commit"] for r in rows})
    cases = ",".join(dict.fromkeys(r["case"] for r in rows)) if rows else args.cases
    several = "" if len(runs) < 2 else (
        f" Rows come from runs of {len(runs)} versions ({'; '.join(runs)}), on the same kind of machine but not "
        "always the same one: a time ratio between rows of different runs is a lead, not a measurement.")
    return (f"# The memory/time frontier ({name})\n\n"
            f"`{_results.command('frontier', ['--device', args.device, '--cases', cases])}`; rows from "
            f"frontier_{tag}.csv "
            "(each row measured in its own model; step time is the median of the timed steps of that row, so "
            "compare times within one table, measured in one run). Methods: bench/frontier.py's docstring." + several)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.case_shapes = dict(CASES)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [c for c in cases if c not in CASES] + [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown case(s)/method(s): {unknown}")
    if args.quick:
        args.case_shapes = {c: (a, 2, 32) for c, (a, _, _) in CASES.items()}
        args.repeats = 1
    csv_path = _results.results_path("frontier", "csv", args.device, args.out)
    done = [] if args.quick or not os.path.exists(csv_path) else _results.read_rows(csv_path)
    if not args.render_only:
        for case in cases:
            for name in methods:
                if METHODS[name].decoder_only and not CASES[case][0].startswith("smollm"):
                    continue
                if not args.force and any(r["case"] == case and r["method"] == name
                                          and (r.get("dtype") or "fp32") == args.dtype for r in done):
                    continue
                row = measure_row(case, name, args)
                print(f"{case:14s} {name:26s} {row.get('step_peak_mib', '-')!s:>10} MiB "
                      f"{row.get('step_s', '-')!s:>8} s  {row['status']}", flush=True)
                done.append(row)
                if not args.quick:
                    _results.append_row(csv_path, row, FIELDS)
    rows = latest(done)
    # every case of the CSV (a run of some cases must not drop the others' tables); --quick: this run's rows
    text = markdown(rows, _header(args, rows))
    print(text)
    if not args.quick:
        _results.write_text(_results.results_path("frontier", "md", args.device, args.out), text)
        plot(rows, _results.results_path("frontier", "png", args.device, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
