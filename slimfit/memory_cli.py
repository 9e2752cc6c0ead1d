"""`slimfit memory <architecture>`: saved-activation bytes per module of a standard architecture,
plain PyTorch vs a slimfit preset, without downloading anything.

    slimfit memory bert-base --batch 1 --seq-len 128 --preset paper --freeze-rate 0.7
    slimfit memory vit-base --image-size 224 --dtype bf16 --collapse-layers

The model is built from its `transformers` config with standard sizes and random weights (no
checkpoint is needed: the bytes autograd saves do not depend on the weights' values). One
training step (forward + backward, train mode, dropout on) runs three times on the same batch
and the same dropout seed, each under `slimfit.memory.measure` (saved-tensor hooks):

  1. plain PyTorch, every parameter trainable (the baseline);
  2. plain PyTorch with the frozen set below (what freezing alone buys);
  3. the model patched with the preset, same frozen set.

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
    parser.description = ("Per-module saved-activation bytes of one training step of an architecture built "
                          "from its config (random weights, nothing downloaded): plain PyTorch vs a slimfit "
                          "preset with the same layers frozen.")
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


def run(args: argparse.Namespace) -> int:
    try:
        arch = archs.resolve(args.architecture)
    except ValueError as exc:
        print(f"slimfit memory: {exc}", file=sys.stderr)
        return 2
    if not (0.0 <= args.freeze_rate < 1.0):
        print(f"slimfit memory: --freeze-rate must be in [0, 1), got {args.freeze_rate}", file=sys.stderr)
        return 2
    if arch.task != archs.IMAGE_CLS and args.image_size is not None:
        print(f"slimfit memory: --image-size applies to vision models; {arch.name} takes --seq-len",
              file=sys.stderr)
        return 2

    import torch

    import slimfit

    from .config import SlimFitConfig

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("slimfit memory: --device cuda but torch sees no CUDA device", file=sys.stderr)
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
    by_name = dict(model.named_parameters())
    cand_numel = sum(by_name[n].numel() for n in candidates)
    frozen_numel = sum(by_name[n].numel() for n in frozen)
    n_params = sum(p.numel() for p in model.parameters())

    plain = archs.measure_step(model, inputs, dtype=args.dtype, seed=args.seed, name="plain")
    archs.set_frozen(model, frozen)
    plain_frozen = archs.measure_step(model, inputs, dtype=args.dtype, seed=args.seed, name="plain, frozen")
    config = SlimFitConfig.preset(args.preset)
    _, summary = slimfit.patch(model, config, return_summary=True)
    archs.set_frozen(model, frozen)
    try:
        patched = archs.measure_step(model, inputs, dtype=args.dtype, seed=args.seed, name=args.preset)
    finally:
        slimfit.unpatch(model)
        archs.set_frozen(model, ())

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
    rows = [("plain PyTorch, all trainable", plain.total, "1.00x"),
            ("plain PyTorch, same layers frozen", plain_frozen.total, _ratio(plain.total, plain_frozen.total)),
            (f"slimfit {args.preset}(), same layers frozen", patched.total, _ratio(plain.total, patched.total))]
    width = max(len(r[0]) for r in rows)
    print(f"Totals (activation bytes saved for backward in one step; per sample = / {args.batch}):")
    for label, total, ratio in rows:
        print(f"  {label:<{width}}  {_mib(total):>13}  {_mib(total / args.batch):>13}/sample  {ratio:>8}")
    print(f"reduction vs plain: {_ratio(plain.total, patched.total)} "
          f"(freezing alone: {_ratio(plain.total, plain_frozen.total)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slimfit memory")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
