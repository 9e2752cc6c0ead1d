"""`slimfit memory <architecture>`: saved-activation bytes per module of a standard architecture, and the
total peak of one training step, plain PyTorch vs a slimfit preset, without downloading anything.

    slimfit memory bert-base --batch 1 --seq-len 128 --preset paper --freeze-rate 0.7
    slimfit memory vit-base --image-size 224 --dtype bf16 --collapse-layers

The model is built from its `transformers` config with standard sizes and random weights (no
checkpoint is needed: the bytes do not depend on the weights' values). Three configurations run
on the same batch and the same dropout seed:

  1. plain PyTorch, every parameter trainable (the baseline);
  2. plain PyTorch with the frozen set below (what freezing alone buys);
  3. the model patched with the preset, same frozen set.

For each: one forward + backward (train mode, dropout on) under `slimfit.memory.measure`
(saved-tensor hooks: the bytes kept for backward, per module), and, unless --saved-only, one
whole training step under `slimfit.step_memory.measure_step` (forward, backward, AdamW step with
lr 0 over the trainable parameters, zero_grad; AdamW's state made beforehand, as in every step
after the first): the step's peak with weights, gradients, optimizer state, saved activations
and transient bytes at the peak.

The frozen set is the one `ILSScheduler(model, freeze_rate, seed=seed)` picks at its first
step: a seeded random `freeze_rate` share of the scheduled layers (the weight matrices; embeddings,
norm weights, biases and a task model's fresh head always train), the same set for runs 2 and 3.

The architectures and the helpers that build, freeze and measure them live in
slimfit/architectures.py (bench/ uses them too); this module is the command only.
"""
from __future__ import annotations

import argparse
import sys

from . import architectures as archs

__all__ = ["add_arguments", "run", "main"]


def _dropout_note(model) -> str:
    from torch import nn

    ps = sorted({m.p for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0})
    cfg = model.config
    attn = next((getattr(cfg, k) for k in ("attention_probs_dropout_prob", "attention_dropout", "attn_pdrop")
                 if isinstance(getattr(cfg, k, None), float)), 0.0)
    if not ps and not attn:
        return "no dropout in this config"
    return f"dropout p={', '.join(f'{p:g}' for p in ps) or '0'}, attention dropout {attn:g}"


def _mib(n: float) -> str:
    """Bytes in KiB below 1 MiB, MiB below 1 GiB, else GiB."""
    for unit, scale in (("KiB", 2**10), ("MiB", 2**20)):
        if n < 1024 * scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n / 2**30:,.2f} GiB"


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


# ------------------------------------------------------------------ the command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    listed = ", ".join(archs.known_names())
    parser.description = ("Per-module saved-activation bytes and the total peak of one training step of an "
                          "architecture built from its config (random weights, nothing downloaded): plain PyTorch "
                          "vs a slimfit preset with the same layers frozen.")
    parser.add_argument("architecture", help=f"one of: {listed}")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence, text models (default 128)")
    parser.add_argument("--image-size", type=int, default=None,
                        help="image side in pixels, vision models (default: the config's, 224)")
    parser.add_argument("--preset", choices=["exact", "paper", "aggressive", "wta_crs"], default="paper",
                        help="slimfit preset (default paper; wta_crs = paper + sampled weight gradients)")
    parser.add_argument("--freeze-rate", type=float, default=0.7,
                        help="share of the scheduler's layers frozen, in [0, 1) (default 0.7, the scheduler's)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="fp32, or bf16 autocast (default fp32)")
    parser.add_argument("--attn-implementation", choices=["sdpa", "eager"], default="sdpa",
                        help="attention of the unpatched model (default sdpa, the transformers default)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, batch, dropout and frozen set")
    parser.add_argument("--collapse-layers", action="store_true",
                        help="one row per role (layer index replaced by *) instead of one per module")
    parser.add_argument("--saved-only", action="store_true",
                        help="only the saved-for-backward bytes, not the total step peak (faster: no optimizer step)")


def _check(args) -> tuple[object, str | None]:
    """(architecture, None) or (None, the error message) for the arguments."""
    try:
        arch = archs.resolve(args.architecture)
    except ValueError as exc:
        return None, str(exc)
    if not (0.0 <= args.freeze_rate < 1.0):
        return None, f"--freeze-rate must be in [0, 1), got {args.freeze_rate}"
    if arch.task != archs.IMAGE_CLS and args.image_size is not None:
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
    saved = archs.measure_step(model, inputs, dtype=args.dtype, seed=args.seed, name=name)
    peak = None if args.saved_only else archs.measure_step_peak(model, inputs, dtype=args.dtype, seed=args.seed,
                                                                name=name, scheduled=scheduled)
    return saved, peak


def _three_runs(model, inputs, frozen, args):
    """Plain, plain with the frozen set, the preset with the frozen set: [(saved, peak)] and the patch summary."""
    import slimfit

    from .config import SlimFitConfig

    runs = [_measure(model, inputs, args, "plain")]
    archs.set_frozen(model, frozen)
    runs.append(_measure(model, inputs, args, "plain, frozen"))
    summary = slimfit.patch(model, SlimFitConfig.preset(args.preset)).slimfit_summary
    archs.set_frozen(model, frozen)
    try:
        runs.append(_measure(model, inputs, args, args.preset, scheduled=True))
    finally:
        slimfit.unpatch(model)
        archs.set_frozen(model, ())
    return runs, summary


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


def _print_saved(arch, runs, summary, args) -> None:
    import slimfit

    plain, plain_frozen, patched = (saved for saved, _ in runs)
    left = "slimfit " + args.preset + "() + frozen"
    print(f"Saved for backward per module: '{left}' (saved, share) vs plain PyTorch, all trainable (baseline)")
    if args.collapse_layers:
        print(slimfit.memory.report(archs.collapse_layers(patched), archs.collapse_layers(plain)))
    else:
        print(slimfit.memory.report(patched, plain))
    print("(a storage saved by several modules counts once, for the first that saves it: e.g. the input shared by "
          "the Q/K/V projections goes to the first trainable one, so a row can grow while the total shrinks)")
    if arch.task == archs.CAUSAL_LM:
        print(_causal_lm_note(summary))
    print()
    width = max(len(label) for label in _labels(args))
    print(f"Totals (activation bytes saved for backward in one step; per sample = / {args.batch}):")
    for label, run in zip(_labels(args), (plain, plain_frozen, patched)):
        print(f"  {label:<{width}}  {_mib(run.total):>13}  {_mib(run.total / args.batch):>13}/sample  "
              f"{_ratio(plain.total, run.total):>8}")
    print(f"reduction vs plain: {_ratio(plain.total, patched.total)} "
          f"(freezing alone: {_ratio(plain.total, plain_frozen.total)})")


def _labels(args) -> list[str]:
    return ["plain PyTorch, all trainable", "plain PyTorch, same layers frozen",
            f"slimfit {args.preset}(), same layers frozen"]


def _print_peaks(runs, args) -> None:
    """The total step peak of each run and its parts at the peak."""
    peaks = [peak for _, peak in runs]
    head = ["", "step peak", "weights", "gradients", "optimizer", "saved", "transient", "at entry", "peak in"]
    body = [[label, _mib(p.total), _mib(p.weights), _mib(p.gradients), _mib(p.optimizer_state), _mib(p.saved),
             _mib(p.transient), _mib(p.resident), p.peak_phase] for label, p in zip(_labels(args), peaks)]
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


def run(args: argparse.Namespace) -> int:
    arch, error = _check(args)
    if error is not None:
        print(f"slimfit memory: {error}", file=sys.stderr)
        return 2
    try:
        model = archs.build(arch, attn_implementation=args.attn_implementation, image_size=args.image_size,
                            seed=args.seed).to(args.device)
        inputs = archs.make_inputs(model, arch.task, args.batch, args.seq_len, args.image_size, seed=args.seed,
                                   device=args.device)
    except ValueError as exc:
        print(f"slimfit memory: {exc}", file=sys.stderr)
        return 2
    frozen, candidates = archs.scheduler_frozen_set(model, args.freeze_rate, seed=args.seed)
    runs, summary = _three_runs(model, inputs, frozen, args)
    _print_header(arch, model, inputs, frozen, candidates, summary, args)
    _print_saved(arch, runs, summary, args)
    if not args.saved_only:
        _print_peaks(runs, args)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slimfit memory")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
