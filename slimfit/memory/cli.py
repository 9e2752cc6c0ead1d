"""`slimfit memory <architecture>` and `slimfit plan <model>`: what a training step costs, measured and predicted,
with one flag vocabulary and one preset list.

    slimfit memory bert-base --batch 1 --seq-len 128 --preset paper --freeze-rate 0.7
    slimfit memory vit-base --image-size 224 --dtype bf16 --collapse-layers
    slimfit plan bert-base --batch 8 --seq-len 256 --preset paper --freeze-rate 0.7
    slimfit plan smollm2-135m --batch 4 --seq-len 1024 --dtype bf16 --lora 16 --checkpointing
    slimfit plan ./config.json --batch 2 --seq-len 2048 --fit 24GiB      # the fastest configuration that fits

The flags both commands take mean the same and are spelled the same (SHARED_FLAGS): --batch, --seq-len,
--image-size, --dtype, --preset (PRESETS: none, exact, paper, aggressive, wta_crs), --freeze-rate (default
DEFAULT_FREEZE_RATE, ILSScheduler's 0.7), --attn-implementation, --device, --seed. --seq, --rate and --attn are
accepted as hidden spellings of --seq-len, --freeze-rate and --attn-implementation. One difference: `slimfit
memory --dtype bf16` is bf16 autocast over fp32 weights, `slimfit plan --dtype bf16` is bf16 weights (the model
held in bf16, as LLMs are fine-tuned; `--dtype bf16-autocast` plans autocast).

`slimfit memory` builds a standard architecture from its `transformers` config with random weights (no checkpoint
is needed: the bytes do not depend on the weights' values) and runs three configurations on the same batch and
the same dropout seed: plain PyTorch, every parameter trainable (the baseline); plain PyTorch with the frozen set
below (what freezing alone buys); the model patched with the preset, same frozen set. For each: one forward +
backward under slimfit.memory.measure (the bytes kept for backward, per module) and, unless --saved-only, one
whole training step under slimfit.memory.measure_step (forward, backward, AdamW step with lr 0, zero_grad;
AdamW's state made beforehand, as in every step after the first): the peak with its parts. The frozen set is
the one `ILSScheduler(model, freeze_rate, seed=seed)` picks at its first step: a seeded random share of the
scheduled layers (the weight matrices; embeddings, norm weights, biases and a task model's fresh head always
train), the same set for the second and third runs.

`slimfit plan` predicts the total peak of one training step on fake tensors (slimfit/memory/plan/): no memory is
allocated, a few seconds for a 100M-parameter model. <model>: an architecture name (`slimfit memory --help` lists
them), a config.json or a folder holding one, or a hub id whose config is already in the local cache.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from typing import Callable

from .._optimizer_state import STATE_CODES
from . import models, runs
from .plan.spec import OPTIMIZER_STATES, PRESETS
from .units import format_bytes, parse_bytes

__all__ = ["MEMORY", "PLAN", "COMMANDS", "Command", "SHARED_FLAGS", "PRESETS", "DEFAULT_FREEZE_RATE",
           "freeze_rate_of", "parse_bytes"]

DEFAULT_FREEZE_RATE = 0.7   # ILSScheduler's default (SchedulerConfig.freeze_rate): one default for both commands

# canonical flag -> (hidden spellings, argparse keywords): what both commands take, in one place
SHARED_FLAGS: dict[str, tuple[tuple[str, ...], dict]] = {
    "--batch": ((), dict(type=int, default=1, help="batch size (default 1)")),
    "--seq-len": (("--seq",), dict(type=int, default=None, help="tokens per sequence, text models")),
    "--image-size": ((), dict(type=int, default=None,
                              help="image side in pixels, vision models (default: the config's)")),
    "--dtype": ((), dict(choices=["fp32", "bf16"], default="fp32", help="fp32, or bf16 autocast (default fp32)")),
    "--preset": ((), dict(choices=list(PRESETS), default="none",
                          help="slimfit preset: none (plain PyTorch, the default), exact, paper, aggressive, or "
                               "wta_crs (paper + sampled weight gradients)")),
    "--freeze-rate": (("--rate",), dict(type=float, default=None, metavar="RATE",
                                        help=f"share of the scheduler's layers frozen each step, in [0, 1) (default "
                                             f"{DEFAULT_FREEZE_RATE:g}, ILSScheduler's; 0: no scheduler)")),
    "--attn-implementation": (("--attn",), dict(choices=["sdpa", "eager"], default="sdpa",
                                                help="attention of the unpatched model (default sdpa, the "
                                                     "transformers default)")),
    "--device": ((), dict(default="cpu", help="cpu (default) or cuda")),
    "--seed": ((), dict(type=int, default=0, help="seed of the weights, batch, dropout and frozen set (default 0)")),
}


def _add_shared(parser: argparse.ArgumentParser, **changes: dict) -> None:
    """SHARED_FLAGS on `parser`, each with its hidden spellings; `changes`: per flag (dest name), keywords that
    differ for this command (a default, a help text)."""
    for flag, (hidden, kwargs) in SHARED_FLAGS.items():
        dest = flag[2:].replace("-", "_")
        kwargs = {**kwargs, **changes.get(dest, {})}
        parser.add_argument(flag, dest=dest, **kwargs)
        extra = {k: v for k, v in kwargs.items() if k in ("type", "choices", "metavar")}
        for spelling in hidden:
            parser.add_argument(spelling, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **extra)


def freeze_rate_of(args: argparse.Namespace) -> float:
    """The freeze rate the arguments ask for: --freeze-rate, else DEFAULT_FREEZE_RATE (0 with --lora, which
    freezes the base: no scheduler)."""
    if args.freeze_rate is not None:
        return args.freeze_rate
    return 0.0 if getattr(args, "lora", None) else DEFAULT_FREEZE_RATE


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand of `slimfit`: its name, one line of help, its arguments and what runs them."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]

    def main(self, argv: list[str] | None = None) -> int:
        """The command on its own (`slimfit <name> ...` without the other commands)."""
        parser = argparse.ArgumentParser(prog=f"slimfit {self.name}")
        self.add_arguments(parser)
        return self.run(parser.parse_args(argv))


# ------------------------------------------------------------------ slimfit memory
_kib = functools.partial(format_bytes, whole_bytes=False)   # the memory tables: KiB and up, two decimals


def _dropout_note(model) -> str:
    from torch import nn

    ps = sorted({m.p for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0})
    cfg = model.config
    attn = next((getattr(cfg, k) for k in ("attention_probs_dropout_prob", "attention_dropout", "attn_pdrop")
                 if isinstance(getattr(cfg, k, None), float)), 0.0)
    if not ps and not attn:
        return "no dropout in this config"
    return f"dropout p={', '.join(f'{p:g}' for p in ps) or '0'}, attention dropout {attn:g}"


def _ratio(base: int, run: int) -> str:
    return "inf" if run == 0 else f"{base / run:.2f}x"


def _causal_lm_note(summary) -> str:
    """What the (root) row of a causal LM holds, and how the Llama-layout pieces were treated."""
    kinds = {kind for _, kind, _ in summary.patched}
    lines = ["(root): the model's own forward, i.e. the loss: plain PyTorch keeps the fp32 logits / log-softmax "
             "(batch x seq x vocab); "
             + ("slimfit's chunked head keeps its input rows and one logsumexp per row (docs/decoders.md)"
                if "causal-lm loss" in kinds else "this preset keeps the model's own head and loss")]
    llama = [k for k in ("swiglu", "rmsnorm") if k in kinds]
    if llama:
        lines.append(f"Llama layout: {' and '.join(llama)} compressed as the preset says; rotary embeddings "
                     "(RoPE) are computed as in transformers (no parameters, nothing patched)")
    return "\n".join(lines)


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `slimfit memory` (slimfit/cli.py adds them to its subcommand)."""
    parser.description = ("Per-module saved-activation bytes and the total peak of one training step of an "
                          "architecture built from its config (random weights, nothing downloaded): plain PyTorch "
                          "vs a slimfit preset with the same layers frozen.")
    parser.add_argument("architecture", help=f"one of: {', '.join(models.known_names())}")
    _add_shared(parser, seq_len=dict(default=128, help="tokens per sequence, text models (default 128)"),
                preset=dict(default="paper", help="slimfit preset compared with plain PyTorch: exact, paper "
                            "(default), aggressive, or wta_crs (paper + sampled weight gradients); none is the "
                            "baseline, which every report shows"))
    parser.add_argument("--collapse-layers", action="store_true",
                        help="one row per role (layer index replaced by *) instead of one per module")
    parser.add_argument("--saved-only", action="store_true",
                        help="only the saved-for-backward bytes, not the total step peak (faster: no optimizer step)")


def _check(args) -> tuple[object, str | None]:
    """(architecture, None) or (None, the error message) for the arguments."""
    try:
        arch = models.resolve(args.architecture)
    except ValueError as exc:
        return None, str(exc)
    if args.preset == "none":
        return None, ("--preset none is plain PyTorch, the baseline every report shows; compare it with exact, "
                      "paper, aggressive or wta_crs")
    if not (0.0 <= args.freeze_rate < 1.0):
        return None, f"--freeze-rate must be in [0, 1), got {args.freeze_rate}"
    if arch.task != models.IMAGE_CLS and args.image_size is not None:
        return None, f"--image-size applies to vision models; {arch.name} takes --seq-len"
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return None, "--device cuda but torch sees no CUDA device"
    return arch, None


def _measure(model, inputs, args, name: str, scheduled: bool = False):
    """(saved bytes of one forward + backward, total step peak or None) of the model as it is now;
    `scheduled`: the frozen layers are the scheduler's, so AdamW keeps their state (every layer trained
    at some earlier step)."""
    saved = runs.saved_of_step(model, inputs, dtype=args.dtype, seed=args.seed, name=name)
    peak = None if args.saved_only else runs.peak_of_step(model, inputs, dtype=args.dtype, seed=args.seed,
                                                                name=name, scheduled=scheduled)
    return saved, peak


def _three_runs(model, inputs, frozen, args):
    """Plain, plain with the frozen set, the preset with the frozen set: [(saved, peak)] and the patch summary."""
    import slimfit

    from ..config import SlimFitConfig

    done = [_measure(model, inputs, args, "plain")]
    runs.set_frozen(model, frozen)
    done.append(_measure(model, inputs, args, "plain, frozen"))
    summary = slimfit.patch(model, SlimFitConfig.preset(args.preset)).slimfit_summary
    runs.set_frozen(model, frozen)
    try:
        done.append(_measure(model, inputs, args, args.preset, scheduled=True))
    finally:
        slimfit.unpatch(model)
        runs.set_frozen(model, ())
    return done, summary


def _print_header(arch, model, inputs, frozen, candidates, summary, args) -> None:
    by_name = dict(model.named_parameters())
    cand_numel = sum(by_name[n].numel() for n in candidates)
    frozen_numel = sum(by_name[n].numel() for n in frozen)
    n_params = sum(p.numel() for p in model.parameters())
    size = (f"seq {inputs['input_ids'].shape[1]}" if "input_ids" in inputs
            else f"image {inputs['pixel_values'].shape[-1]}x{inputs['pixel_values'].shape[-2]}")
    print(f"slimfit memory: {arch.name} ({type(model).__name__}, {n_params / 1e6:.1f}M parameters, random weights)")
    print(f"  batch {args.batch}, {size}, {args.dtype}{' autocast' if args.dtype != 'fp32' else ''}, "
          f"train mode ({_dropout_note(model)}), {args.device}, attention {args.attn_implementation}")
    share = f"{100.0 * frozen_numel / cand_numel:.1f}% of their weights" if cand_numel else "no weights"
    print(f"  frozen: {len(frozen)} of {len(candidates)} scheduled layers (ILSScheduler first step, "
          f"freeze rate {args.freeze_rate}, seed {args.seed}; {share})")
    print(f"  {summary}".replace("\n", "\n  "))
    print()


def _print_saved(arch, measured, summary, args) -> None:
    """The per-module table of the preset against plain PyTorch, then the three runs' totals."""
    from .saved import report

    plain, plain_frozen, patched = (saved for saved, _ in measured)
    left = "slimfit " + args.preset + "() + frozen"
    print(f"Saved for backward per module: '{left}' (saved, share) vs plain PyTorch, all trainable (baseline)")
    if args.collapse_layers:
        print(report(runs.collapse_layers(patched), runs.collapse_layers(plain)))
    else:
        print(report(patched, plain))
    print("(a storage saved by several modules counts once, for the first that saves it: e.g. the input shared by "
          "the Q/K/V projections goes to the first trainable one, so a row can grow while the total shrinks)")
    if arch.task == models.CAUSAL_LM:
        print(_causal_lm_note(summary))
    print()
    width = max(len(label) for label in _labels(args))
    print(f"Totals (activation bytes saved for backward in one step; per sample = / {args.batch}):")
    for label, run in zip(_labels(args), (plain, plain_frozen, patched)):
        print(f"  {label:<{width}}  {_kib(run.total):>13}  {_kib(run.total / args.batch):>13}/sample  "
              f"{_ratio(plain.total, run.total):>8}")
    print(f"reduction vs plain: {_ratio(plain.total, patched.total)} "
          f"(freezing alone: {_ratio(plain.total, plain_frozen.total)})")


def _labels(args) -> list[str]:
    return ["plain PyTorch, all trainable", "plain PyTorch, same layers frozen",
            f"slimfit {args.preset}(), same layers frozen"]


def _print_peaks(measured, args) -> None:
    """The total step peak of each run and its parts at the peak."""
    peaks = [peak for _, peak in measured]
    head = ["", "step peak", "weights", "gradients", "optimizer", "saved", "transient", "at entry", "peak in"]
    body = [[label, _kib(p.total), _kib(p.weights), _kib(p.gradients), _kib(p.optimizer_state), _kib(p.saved),
             _kib(p.transient), _kib(p.resident), p.peak_phase] for label, p in zip(_labels(args), peaks)]
    widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]
    print()
    print("Total step peak (one training step: forward, backward, AdamW step, zero_grad; AdamW state already made, "
          "as in every step after the first; parts at the peak):")
    for row in [head] + body:
        print("  " + "  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]))
    print(f"  ({peaks[0].device}: {peaks[0].method}; 'saved' here is what is still live at the peak)")
    print("  (the slimfit row's AdamW covers every parameter, as under the scheduler: a frozen layer keeps the state "
          "it made when it trained; the plain frozen row's layers are frozen for good and have none)")
    print(f"step peak reduction vs plain: {_ratio(peaks[0].total, peaks[2].total)} "
          f"(freezing alone: {_ratio(peaks[0].total, peaks[1].total)})")


def run_memory(args: argparse.Namespace) -> int:
    """Run `slimfit memory` for parsed arguments; 2 (and the reason on stderr) for arguments it cannot run."""
    args.freeze_rate = freeze_rate_of(args)
    arch, error = _check(args)
    if error is not None:
        print(f"slimfit memory: {error}", file=sys.stderr)
        return 2
    try:
        model = models.build(arch, attn_implementation=args.attn_implementation, image_size=args.image_size,
                            seed=args.seed).to(args.device)
        inputs = models.make_inputs(model, arch.task, args.batch, args.seq_len, args.image_size, seed=args.seed,
                                   device=args.device)
    except ValueError as exc:
        print(f"slimfit memory: {exc}", file=sys.stderr)
        return 2
    frozen, candidates = runs.scheduler_frozen_set(model, args.freeze_rate, seed=args.seed)
    measured, summary = _three_runs(model, inputs, frozen, args)
    _print_header(arch, model, inputs, frozen, candidates, summary, args)
    _print_saved(arch, measured, summary, args)
    if not args.saved_only:
        _print_peaks(measured, args)
    return 0


# ------------------------------------------------------------------ slimfit plan
_plan_size = functools.partial(format_bytes, decimals=1, whole_bytes=False)   # KiB and MiB one decimal


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `slimfit plan` (slimfit/cli.py adds them to its subcommand)."""
    parser.description = ("Predict the total peak memory of one training step (forward, backward, optimizer "
                          "step) before the run, without allocating it; --fit finds the fastest configuration "
                          "under a budget.")
    parser.add_argument("model", help=f"an architecture ({', '.join(models.known_names())}), a config.json or its "
                        "folder, or a hub id whose config is in the local cache")
    _add_shared(parser, batch=dict(default=None, required=True, help="batch size"),
                freeze_rate=dict(help=f"share of ILSScheduler's layers frozen each step, in [0, 1) (default "
                                      f"{DEFAULT_FREEZE_RATE:g}, its default; 0: no scheduler; with --lora: 0, the "
                                      "base is frozen)"),
                device=dict(help="the step's device: cpu (default; exact), or cuda (an estimate: docs/plan.md)"),
                dtype=dict(choices=["fp32", "bf16", "fp16", "bf16-autocast"],
                           help="the weights' dtype: fp32 (default), bf16 or fp16 (the model held in it, AdamW's "
                                "moments too, as torch makes them); or bf16-autocast (fp32 weights, bf16 autocast)"))
    parser.add_argument("--lora", type=int, default=None, metavar="R", help="LoRA rank (peft); the base is frozen")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing of every layer")
    parser.add_argument("--optimizer", choices=["adamw", "adamw8bit", "adamw8bit-bnb"], default="adamw",
                        help="adamw (torch), adamw8bit (torchao, when installed) or adamw8bit-bnb (bitsandbytes, "
                             "not paged; with --device cuda: its fused step)")
    parser.add_argument("--task", choices=[models.TEXT_CLS, models.CAUSAL_LM, models.IMAGE_CLS], default=None,
                        help="override the task the config implies")
    parser.add_argument("--optimizer-state", choices=list(OPTIMIZER_STATES), default=None,
                        help="with a freeze rate, how AdamW's moments are held (ILSScheduler's optimizer_state): "
                             "every layer's 8-bit (8bit), the frozen layers' 8-bit (8bit-frozen), the frozen "
                             "layers' in host memory (host-frozen; saves only on a GPU), every layer's in host "
                             "memory (host; with --step-in-backward), or in full (full); auto (the scheduler's "
                             "default) is 8bit with adamw, nothing held with adamw8bit")
    parser.add_argument("--step-in-backward", action="store_true",
                        help="the optimizer stepped inside backward, each gradient freed after its step "
                             "(slimfit.optim.step_in_backward)")
    parser.add_argument("--warmup-steps", default=0, type=_warmup_steps_arg, metavar="N",
                        help="with a freeze rate, the scheduler's rate ramp in steps for the predicted step: 0 "
                             "(default) predicts the frozen set at the rate; auto (the scheduler's default: 100 "
                             "for a causal LM, else 0) or N predicts the ramp's first step, the run's worst")
    parser.add_argument("--scheduled-kinds", default=None, type=_kinds_arg, metavar="KINDS",
                        help="with a freeze rate, what the scheduler freezes: all, or kinds joined by commas "
                             "(matmul, norm, embedding; e.g. matmul,embedding: the embeddings scheduled too); "
                             "default: the scheduler's, the weight matrices")
    parser.add_argument("--state-code", default=None, choices=list(STATE_CODES),
                        help="with a freeze rate, how the held moments are coded (ILSScheduler's state_code): "
                             "dynamic8 (its default), dynamic4 (4-bit), linear8, ...")
    parser.add_argument("--embeddings", default="train", choices=["train", "freeze"],
                        help="with a freeze rate, the scheduler's embeddings: train (its default) or freeze (the "
                             "input embedding table, and a head tied to it, held frozen for the run)")
    parser.add_argument("--world-size", type=int, default=1, metavar="N",
                        help="predict one rank of FSDP2 over N ranks (each transformer layer and the root "
                             "wrapped by fully_shard; --batch per rank); default 1, one process")
    parser.add_argument("--chunked-loss", action="store_true",
                        help="a causal LM's loss chunked (no logits kept) without a preset too; the presets do it")
    # --optimizer-state's older name and values
    parser.add_argument("--frozen-state", default=None, help=argparse.SUPPRESS,
                        choices=["auto", "none", "compress", "offload", "compress_all", "offload_all"])
    parser.add_argument("--fit", default=None, metavar="BUDGET",
                        help="search presets, rates, optimizer-state options, LoRA and checkpointing at this batch "
                             "for the fastest configuration whose step peak fits BUDGET (e.g. 24GiB), print its code")




def _kinds_arg(text: str):
    """--scheduled-kinds: "all" or kinds joined by commas (checked by the spec)."""
    return text if text == "all" else tuple(k.strip() for k in text.split(",") if k.strip())


def _warmup_steps_arg(text: str):
    """--warmup-steps: "auto" or an int >= 0."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number of steps >= 0, got {text!r}")
    return int(text)


def _optimizer_state(args) -> str:
    """--optimizer-state, or --frozen-state (its older name) read as it; "auto" when neither is given."""
    from .._optimizer_state import from_frozen_state

    legacy = None if args.frozen_state is None else from_frozen_state(
        None if args.frozen_state == "none" else args.frozen_state)
    if legacy is not None and args.optimizer_state not in (None, legacy):
        raise SystemExit(f"slimfit plan: --optimizer-state {args.optimizer_state} and --frozen-state "
                         f"{args.frozen_state} (its older name) disagree; give --optimizer-state alone")
    return args.optimizer_state or legacy or "auto"


def _spec(args, **changes):
    """The StepSpec the arguments describe, with `changes` applied."""
    from .plan.spec import StepSpec

    values = dict(batch=args.batch, seq=args.seq_len, image_size=args.image_size, dtype=args.dtype,
                  optimizer=args.optimizer, preset=args.preset, rate=freeze_rate_of(args), lora=args.lora,
                  checkpointing=args.checkpointing, attn=args.attn_implementation, device=args.device,
                  task=args.task, seed=args.seed, step_in_backward=args.step_in_backward,
                  chunked_loss=args.chunked_loss, warmup_steps=args.warmup_steps,
                  optimizer_state=_optimizer_state(args), scheduled_kinds=args.scheduled_kinds,
                  world_size=args.world_size, state_code=args.state_code, embeddings=args.embeddings)
    values.update(changes)
    return StepSpec(args.model, **values)


def _header(p) -> list[str]:
    """The lines that say what was predicted: model, shape, configuration, the scheduler's frozen set."""
    spec = p.spec
    lines = [f"slimfit plan: {p.model_name} ({p.params / 1e6:.1f}M parameters, {spec.device}); {spec.shape()}, "
             f"{spec.label()}"]
    if spec.rate:
        lines.append(f"  ILSScheduler: {p.frozen_layers} of {p.layers} layers frozen in this step "
                     f"(its first frozen set, seed {spec.seed}); AdamW state for every parameter")
        if p.warmup_steps:
            lines.append(f"  the rate ramps from 0 to {spec.rate:g} over the first {p.warmup_steps} steps: this "
                         "first step is the run's worst")
        elif p.causal_lm:
            lines.append("  the frozen set at the rate: ILSScheduler's default for a causal LM ramps the rate from 0 "
                         "over its first 100 steps, which train more layers (--warmup-steps auto predicts the "
                         "first; ILSScheduler(..., warmup_steps=0) freezes at the rate from the first step)")
    lines.append(f"  trainable now: {p.trained / 1e6:.2f}M parameters; optimizer state for {p.optimized / 1e6:.2f}M")
    if spec.world_size > 1:
        where = ("with gloo's copy of each reduce-scatter input, as the CPU's process group runs it"
                 if spec.device == "cpu" else "its collectives in place and finished at once, as NCCL's would be "
                 "were nothing overlapped: not verified on a GPU")
        lines.append(f"  FSDP2: rank 0 of {spec.world_size} (every transformer layer and the root sharded; the batch "
                     f"per rank), {where} (bench/results/sharded_cpu.md: measured against predicted)")
    return lines


def plan_report(p) -> str:
    """The prediction as text: the peak, its parts, where it is, the estimated step time."""
    m = p.memory
    rows = [("predicted step peak", m.total), ("  weights", m.weights), ("  gradients", m.gradients),
            ("  optimizer state", m.optimizer_state), ("  saved activations", m.saved), ("  transient", m.transient),
            ("resident at entry", m.resident)]
    width = max(len(label) for label, _ in rows)
    lines = _header(p) + [""] + [f"{label:<{width}}  {_plan_size(v):>12}" for label, v in rows]
    lines.append(f"{'peak in':<{width}}  {m.peak_phase:>12}")
    where = "one thread's CPU time here" if p.spec.device == "cpu" else "an H100-class GPU"
    lines.append(f"estimated step time: {p.step_time():.3g} s ({where}; slimfit/memory/plan/cost.py: for ranking "
                 "configurations, not a benchmark)")
    note = "exact for the CPU step" if p.spec.device == "cpu" else (
        "an estimate for CUDA: the CPU step with CUDA's foreach AdamW; add the CUDA context and allocator slack")
    lines.append(f"(predicted in {p.seconds:.1f} s on fake tensors, nothing allocated; {note}; docs/plan.md)")
    if p.checks_answered:
        lines.append(f"({p.checks_answered} data-dependent check(s) in the step answered as in a healthy step: "
                     "values finite)")
    return "\n".join(lines)


def _fit(args) -> int:
    """--fit: search (slimfit/memory/plan/search.py), print the candidates tried, the fastest that fits and its
    code; 1 if none."""
    from .plan.code import render
    from .plan.search import fit

    if args.world_size > 1:
        raise ValueError("--fit with --world-size: a sharded rank's prediction is checked on gloo ranks only (on "
                         "a GPU, collectives that overlap keep buffers longer), so it cannot promise a fit; plan the "
                         "sharded step without --fit, and measure it (python -m bench.sharded)")
    budget = parse_bytes(args.fit)
    base = _spec(args)
    print(f"slimfit plan --fit {_plan_size(budget)}: {base.model_name}, {base.shape()}, {base.dtype}, "
          f"{base.optimizer}; searching presets x rates x checkpointing, and LoRA", flush=True)
    result = fit(base, budget, lora_rank=args.lora,
                 on_candidate=lambda c: print(f"  predicted {c.spec.label():40s} {_plan_size(c.total):>12}  {c.status}",
                                              flush=True),
                 on_progress=lambda line: print(f"slimfit plan --fit: {line}", file=sys.stderr, flush=True))
    print()
    print(_table(result))
    if result.best is None:
        print(f"\nnothing fits {_plan_size(budget)} at batch {base.batch}: lower the batch or the sequence length")
        return 1
    best = result.best.prediction
    print(f"\nfastest that fits: {best.spec.label()}: {_plan_size(best.total)} predicted "
          f"({100.0 * best.total / budget:.0f}% of the budget)\n")
    print(render(best, budget_bytes=_scheduler_budget(best, budget)))
    return 0


def _scheduler_budget(p, budget: int) -> int | None:
    """The budget for the scheduler's budget mode when it can keep it (its base and cheapest layer fit), so
    that the frozen sets of later steps stay within it; None otherwise (or without a scheduler)."""
    if not p.spec.rate:
        return None
    from .plan.budget import scheduler_budget

    b = scheduler_budget(p.spec, budget)
    return budget if b["base_bytes"] + min(b["activation_bytes"].values(), default=0) <= budget else None


def _table(result) -> str:
    """The candidates, fastest (estimated) first, with their estimated time relative to the fastest."""
    fastest = min(c.est_seconds for c in result.candidates)
    head = f"  {'configuration':40s} {'est. time':>9}  {'resident':>10}  {'step peak':>10}  status"
    lines = ["candidates, fastest first (est. time relative to the fastest; resident: weights + optimizer state):",
             head]
    for c in result.candidates:
        peak = _plan_size(c.total) if c.total is not None else "-"
        lines.append(f"  {c.spec.label():40s} {c.est_seconds / fastest:>8.2f}x  {_plan_size(c.resident):>10}  "
                     f"{peak:>10}  {c.status}")
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    """Run `slimfit plan` for parsed arguments; 2 (and the reason on stderr) for arguments that cannot be planned."""
    from .plan.predict import predict

    try:
        if args.fit is not None:
            return _fit(args)
        spec = _spec(args)
        print(plan_report(predict(spec)))
        if spec.rate and spec.budget_bytes is None:
            from .plan.budget import rate_bound

            print(f"any later step at rate {spec.rate:g} (another trained set): at most {_plan_size(rate_bound(spec))} "
                  "(the all-frozen peak plus the largest layers' bytes as many as train; docs/plan.md). To hold "
                  "a budget at every step: --fit, or ILSScheduler(budget_bytes=...)")
    except (ValueError, TypeError) as exc:
        print(f"slimfit plan: {exc}", file=sys.stderr)
        return 2
    return 0


MEMORY = Command("memory", "per-module saved-activation report of an architecture, plain vs a preset",
                 add_memory_arguments, run_memory)
PLAN = Command("plan", "predict a training step's peak memory before the run; --fit: the fastest configuration "
               "under a budget", add_plan_arguments, run_plan)
COMMANDS = (MEMORY, PLAN)
