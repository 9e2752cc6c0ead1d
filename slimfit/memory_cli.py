"""`slimfit memory <architecture>`: saved-activation bytes per module of a standard architecture,
plain PyTorch vs a slimfit preset, without downloading anything.

    slimfit memory bert-base --batch 1 --seq-len 128 --preset paper --freeze-rate 0.9
    slimfit memory vit-base --image-size 224 --dtype bf16 --collapse-layers

The model is built from its `transformers` config with standard sizes and random weights (no
checkpoint is needed: the bytes autograd saves do not depend on the weights' values). One
training step (forward + backward, train mode, dropout on) runs three times on the same batch
and the same dropout seed, each under `slimfit.memory.measure` (saved-tensor hooks):

  1. plain PyTorch, every parameter trainable (the baseline);
  2. plain PyTorch with the frozen set below (what freezing alone buys);
  3. the model patched with the preset, same frozen set.

The frozen set is the one `ILSScheduler(model, freeze_rate, seed=seed)` picks at its first
step: a seeded random `freeze_rate` share of the candidate layers (weight matrices, embeddings
and norm weights; biases always train), the same set for runs 2 and 3.

The helpers (`ARCHITECTURES`, `build`, `make_inputs`, `scheduler_frozen_set`, `set_frozen`,
`measure_step`) are also used by bench/patch_memory.py.
"""
from __future__ import annotations

import argparse
import contextlib
import re
import sys
from dataclasses import dataclass, field

__all__ = ["ARCHITECTURES", "Architecture", "add_arguments", "run", "build", "make_inputs",
           "scheduler_frozen_set", "set_frozen", "measure_step", "collapse_layers", "collapse_layers_name",
           "resolve"]

TEXT_CLS, CAUSAL_LM, IMAGE_CLS = "text-classification", "causal-lm", "image-classification"


@dataclass(frozen=True)
class Architecture:
    name: str
    task: str                      # TEXT_CLS | CAUSAL_LM | IMAGE_CLS
    config_class: str              # transformers config class
    model_class: str               # transformers model class
    config: dict = field(default_factory=dict)  # overrides of the config class's defaults
    about: str = ""
    hidden: bool = False           # accepted, not listed (tests)


_BERT_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in [
    Architecture("bert-base", TEXT_CLS, "BertConfig", "BertForSequenceClassification", {},
                 "BERT-base: 12 layers, hidden 768, 12 heads (110M)"),
    Architecture("bert-large", TEXT_CLS, "BertConfig", "BertForSequenceClassification", dict(_BERT_LARGE),
                 "BERT-large: 24 layers, hidden 1024, 16 heads (335M)"),
    Architecture("roberta-base", TEXT_CLS, "RobertaConfig", "RobertaForSequenceClassification",
                 dict(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5,
                      pad_token_id=1, bos_token_id=0, eos_token_id=2),
                 "RoBERTa-base: 12 layers, hidden 768 (125M)"),
    Architecture("distilbert", TEXT_CLS, "DistilBertConfig", "DistilBertForSequenceClassification", {},
                 "DistilBERT-base: 6 layers, hidden 768 (66M)"),
    Architecture("vit-base", IMAGE_CLS, "ViTConfig", "ViTForImageClassification", {},
                 "ViT-B/16: 12 layers, hidden 768, 224x224 (86M)"),
    Architecture("vit-large", IMAGE_CLS, "ViTConfig", "ViTForImageClassification", dict(_BERT_LARGE),
                 "ViT-L/16: 24 layers, hidden 1024, 224x224 (304M)"),
    Architecture("gpt2", CAUSAL_LM, "GPT2Config", "GPT2LMHeadModel", {},
                 "GPT-2 small: 12 layers, hidden 768 (124M)"),
    Architecture("smollm-135m", CAUSAL_LM, "LlamaConfig", "LlamaForCausalLM",
                 dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, tie_word_embeddings=True),
                 "Llama layout, SmolLM-135M sizes: 30 layers, hidden 576, GQA 9/3 heads (135M)"),
    Architecture("smollm2-135m", CAUSAL_LM, "LlamaConfig", "LlamaForCausalLM",
                 dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, tie_word_embeddings=True),
                 "Llama layout, SmolLM2-135M sizes (the demo's decoder): 30 layers, hidden 576, GQA 9/3 heads, "
                 "8k positions (135M)"),
    Architecture("llama-small", CAUSAL_LM, "LlamaConfig", "LlamaForCausalLM",
                 dict(vocab_size=8000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096),
                 "Llama layout, small: 4 layers, hidden 256, GQA 8/2 heads, vocab 8000 (issue 14's decoder, 10M)"),
    Architecture("tinyllama-1.1b", CAUSAL_LM, "LlamaConfig", "LlamaForCausalLM",
                 dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                      rms_norm_eps=1e-5),
                 "Llama layout, TinyLlama-1.1B sizes: 22 layers, hidden 2048 "
                 "(1.1B: ~10 GiB of memory in fp32, weights + gradients)"),
    # Hidden: a BERT small enough for tests and quick checks (not a published size).
    Architecture("bert-tiny", TEXT_CLS, "BertConfig", "BertForSequenceClassification",
                 dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=128, max_position_embeddings=128),
                 "BERT-tiny (tests): 2 layers, hidden 64, vocab 1000", hidden=True),
    Architecture("llama-tiny", CAUSAL_LM, "LlamaConfig", "LlamaForCausalLM",
                 dict(vocab_size=1000, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5),
                 "Llama-tiny (tests, benchmarks): 2 layers, hidden 64, GQA 4/2 heads, vocab 1000", hidden=True),
]}

_ALIASES = {"bert": "bert-base", "roberta": "roberta-base", "vit": "vit-base", "vit-b16": "vit-base",
            "vit-l16": "vit-large", "distilbert-base": "distilbert", "gpt2-small": "gpt2",
            "smollm": "smollm-135m", "smollm2": "smollm2-135m", "tinyllama": "tinyllama-1.1b"}


def known_names() -> list[str]:
    return [n for n, a in ARCHITECTURES.items() if not a.hidden]


def resolve(name: str) -> Architecture:
    """The architecture called `name` (case, '_' and '-' are not significant); ValueError
    naming the known ones otherwise."""
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; known architectures: {', '.join(known_names())}")
    return ARCHITECTURES[key]


# ------------------------------------------------------------------ building blocks
def build(arch: Architecture | str, *, attn_implementation: str = "sdpa", image_size: int | None = None,
          seed: int = 0, num_labels: int = 2):
    """The model of `arch` with random weights (seeded), in train mode."""
    import torch
    import transformers

    arch = resolve(arch) if isinstance(arch, str) else arch
    overrides = dict(arch.config)
    if arch.task != CAUSAL_LM:
        overrides["num_labels"] = num_labels
    if arch.task == IMAGE_CLS and image_size is not None:
        overrides["image_size"] = image_size
    config = getattr(transformers, arch.config_class)(**overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, arch.model_class)(config)
    model.set_attn_implementation(attn_implementation)
    model.train()
    return model


def max_tokens(model) -> int | None:
    cfg = model.config
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(cfg, key, None)
        if value:
            # RoBERTa's first two positions are reserved for the padding index.
            return int(value) - (int(cfg.pad_token_id) + 1 if getattr(cfg, "model_type", "") == "roberta" else 0)
    return None


def make_inputs(model, task: str, batch: int, seq_len: int = 128, image_size: int | None = None,
                seed: int = 0, device="cpu") -> dict:
    """A random batch with labels for `model` (token ids avoid the special ids 0-3)."""
    import torch

    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    if task == IMAGE_CLS:
        size = image_size or cfg.image_size
        if size % cfg.patch_size:
            raise ValueError(f"image size {size} is not a multiple of the patch size {cfg.patch_size}")
        inputs = {"pixel_values": torch.randn(batch, cfg.num_channels, size, size, generator=g),
                  "labels": torch.randint(0, cfg.num_labels, (batch,), generator=g)}
    else:
        limit = max_tokens(model)
        if seq_len < 1 or (limit is not None and seq_len > limit):
            raise ValueError(f"seq-len must be in [1, {limit}] for this architecture, got {seq_len}")
        ids = torch.randint(4, cfg.vocab_size, (batch, seq_len), generator=g)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if task == CAUSAL_LM:
            inputs["labels"] = ids.clone()
        else:
            inputs["labels"] = torch.randint(0, cfg.num_labels, (batch,), generator=g)
    return {k: v.to(device) for k, v in inputs.items()}


def scheduler_frozen_set(model, freeze_rate: float, seed: int = 0) -> tuple[list[str], list[str]]:
    """(frozen, candidates): the layers ILSScheduler(model, freeze_rate, seed=seed) freezes at its
    first step (a seeded random share: no layer has a score yet). Leaves every parameter trainable."""
    from .scheduler import ILSScheduler

    set_frozen(model, ())  # candidates are the parameters that require grad
    sched = ILSScheduler(model, freeze_rate=freeze_rate, seed=seed)
    frozen, candidates = sched.frozen_names(), list(sched.names)
    del sched
    set_frozen(model, ())
    return frozen, candidates


def set_frozen(model, names) -> None:
    """Freeze exactly the parameters named in `names`; every other parameter trains."""
    names = set(names)
    for n, p in model.named_parameters():
        p.requires_grad_(n not in names)
        if n in names:
            p.grad = None


def autocast_context(dtype: str, device="cpu"):
    import torch

    if dtype == "fp32":
        return contextlib.nullcontext()
    if dtype == "bf16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    raise ValueError(f"dtype must be fp32 or bf16, got {dtype!r}")


def measure_step(model, inputs: dict, *, dtype: str = "fp32", seed: int = 0, name: str = ""):
    """slimfit.memory.measure of one forward + backward (dropout seeded); grads dropped after."""
    import torch

    from . import memory

    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    with autocast_context(dtype, device):
        result = memory.measure(model, **inputs)
    model.zero_grad(set_to_none=True)
    result.name = name
    return result


_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")


def collapse_layers_name(path: str) -> str:
    """`bert.encoder.layer.3.output.dense` -> `bert.encoder.layer.*.output.dense`."""
    return _LAYER_INDEX.sub(".*", path)


def collapse_layers(run):
    """A copy of a SavedMemory with the layer indices of module paths replaced by '*'
    (`bert.encoder.layer.*.attention.self`): one row per role, same total."""
    from .memory import SavedMemory

    out = SavedMemory(total=run.total, excluded=run.excluded, name=run.name)
    for path, nbytes in run.per_module.items():
        key = collapse_layers_name(path)
        out.per_module[key] = out.per_module.get(key, 0) + nbytes
        out.counts[key] = out.counts.get(key, 0) + run.counts.get(path, 0)
    return out


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
    listed = ", ".join(known_names())
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
    parser.add_argument("--freeze-rate", type=float, default=0.9,
                        help="share of the scheduler's candidate layers frozen, in [0, 1) (default 0.9)")
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
        arch = resolve(args.architecture)
    except ValueError as exc:
        print(f"slimfit memory: {exc}", file=sys.stderr)
        return 2
    if not (0.0 <= args.freeze_rate < 1.0):
        print(f"slimfit memory: --freeze-rate must be in [0, 1), got {args.freeze_rate}", file=sys.stderr)
        return 2
    if arch.task != IMAGE_CLS and args.image_size is not None:
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
        model = build(arch, attn_implementation=args.attn_implementation, image_size=args.image_size,
                      seed=args.seed).to(args.device)
        inputs = make_inputs(model, arch.task, args.batch, args.seq_len, args.image_size, seed=args.seed,
                             device=args.device)
    except ValueError as exc:
        print(f"slimfit memory: {exc}", file=sys.stderr)
        return 2

    frozen, candidates = scheduler_frozen_set(model, args.freeze_rate, seed=args.seed)
    by_name = dict(model.named_parameters())
    cand_numel = sum(by_name[n].numel() for n in candidates)
    frozen_numel = sum(by_name[n].numel() for n in frozen)
    n_params = sum(p.numel() for p in model.parameters())

    plain = measure_step(model, inputs, dtype=args.dtype, seed=args.seed, name="plain")
    set_frozen(model, frozen)
    plain_frozen = measure_step(model, inputs, dtype=args.dtype, seed=args.seed, name="plain, frozen")
    config = SlimFitConfig.preset(args.preset)
    _, summary = slimfit.patch(model, config, return_summary=True)
    set_frozen(model, frozen)
    try:
        patched = measure_step(model, inputs, dtype=args.dtype, seed=args.seed, name=args.preset)
    finally:
        slimfit.unpatch(model)
        set_frozen(model, ())

    size = (f"seq {inputs['input_ids'].shape[1]}" if "input_ids" in inputs
            else f"image {inputs['pixel_values'].shape[-1]}x{inputs['pixel_values'].shape[-2]}")
    print(f"slimfit memory: {arch.name} ({type(model).__name__}, {n_params / 1e6:.1f}M parameters, random weights)")
    print(f"  batch {args.batch}, {size}, {args.dtype}{' autocast' if args.dtype != 'fp32' else ''}, "
          f"train mode ({_dropout_note(model)}), {args.device}, attention {args.attn_implementation}")
    share = f"{100.0 * frozen_numel / cand_numel:.1f}% of their weights" if cand_numel else "no weights"
    print(f"  frozen: {len(frozen)} of {len(candidates)} candidate layers (ILSScheduler first step, "
          f"freeze rate {args.freeze_rate}, seed {args.seed}; {share})")
    print(f"  {summary}".replace("\n", "\n  "))
    print()
    left = "slimfit " + args.preset + "() + frozen"
    print(f"Saved for backward per module: '{left}' (saved, share) vs plain PyTorch, all trainable (baseline)")
    if args.collapse_layers:
        print(slimfit.memory.report(collapse_layers(patched), collapse_layers(plain)))
    else:
        print(slimfit.memory.report(patched, plain))
    print("(a storage saved by several modules counts once, for the first that saves it: e.g. the input shared by "
          "the Q/K/V projections goes to the first trainable one, so a row can grow while the total shrinks)")
    if arch.task == CAUSAL_LM:
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
