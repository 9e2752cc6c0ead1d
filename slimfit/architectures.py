"""Standard transformer architectures built from their `transformers` config with random weights
(nothing downloaded: the bytes autograd saves do not depend on the weights' values), a random batch
for each, and the one-step measurement helpers that `slimfit memory` (memory_cli.py) and the scripts
of bench/ share.

    from slimfit import architectures as A
    model = A.build("bert-base", seed=0)                       # train mode, sdpa attention
    inputs = A.make_inputs(model, A.resolve("bert-base").task, batch=2, seq_len=128)
    frozen, candidates = A.scheduler_frozen_set(model, 0.9)   # ILSScheduler's first frozen set
    A.set_frozen(model, frozen)
    run = A.measure_step(model, inputs)                        # slimfit.memory.SavedMemory of one step
    peak = A.measure_step_peak(model, inputs)                  # slimfit.step_memory.StepMemory: the whole
                                                               # step's peak (AdamW), weights to temporaries

`resolve(name)` accepts the names `slimfit memory --help` lists, aliases (bert, vit, gpt2-small,
smollm2, tinyllama, ...) and the hidden test sizes (bert-tiny, llama-tiny).
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

__all__ = ["ARCHITECTURES", "Architecture", "TEXT_CLS", "CAUSAL_LM", "IMAGE_CLS", "known_names", "resolve", "build",
           "max_tokens", "make_inputs", "scheduler_frozen_set", "set_frozen", "autocast_context", "measure_step",
           "adamw", "prime_optimizer", "measure_step_peak", "collapse_layers", "collapse_layers_name"]

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


def adamw(model, lr: float = 0.0, every_parameter: bool = False):
    """AdamW over the parameters that require grad, or over every parameter (`every_parameter`: a model
    trained under the scheduler, whose frozen layers keep their optimizer state). lr=0 by default: a
    measured step does all of AdamW's work (moments, temporaries) and leaves the weights as they were."""
    import torch

    return torch.optim.AdamW([p for p in model.parameters() if every_parameter or p.requires_grad], lr=lr)


def prime_optimizer(optimizer) -> None:
    """Create the optimizer's lazy state (AdamW's moments) without a forward or backward: one step on zero
    gradients for the parameters that have no state yet, then the gradients dropped. A step measured after
    this finds the state resident, as every step after the first does; that includes the parameters frozen
    now: under a scheduler every layer has trained at some step, and the optimizer keeps its state."""
    import torch

    params = [p for g in optimizer.param_groups for p in g["params"]
              if p.grad is None and not optimizer.state.get(p)]
    if not params:
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    # the step without the optimizer's own hooks: the scheduler's guard drops the gradients of frozen layers
    # before a step, and those layers' state is what is being made here
    hooks = [getattr(optimizer, name, None) for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")]
    saved = [dict(h) if h is not None else None for h in hooks]
    for h in hooks:
        if h is not None:
            h.clear()
    try:
        optimizer.step()
    finally:
        for h, kept in zip(hooks, saved):
            if h is not None:
                h.update(kept)
    for p in params:
        p.grad = None


def measure_step_peak(model, inputs: dict, *, dtype: str = "fp32", optimizer=None, seed: int = 0,
                      extra: dict | None = None, after_step=None, prime: bool = True, name: str = "",
                      scheduled: bool = False):
    """slimfit.step_memory.measure_step of one whole training step: forward (autocast for bf16, dropout
    seeded), backward, optimizer step, zero_grad (+ after_step). The optimizer defaults to `adamw(model)`
    (lr 0; `scheduled`: over every parameter, as under the scheduler, whose frozen layers keep their state),
    primed so that its state is resident as in any step after the first (prime=False: the first step, state
    created inside it). Returns a StepMemory."""
    import torch

    from . import step_memory

    optimizer = adamw(model, every_parameter=scheduled) if optimizer is None else optimizer
    if prime:
        prime_optimizer(optimizer)
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    batch = {**inputs, **(extra or {})}

    def forward():
        with autocast_context(dtype, device):
            return model(**batch)

    torch.manual_seed(seed)
    return step_memory.measure_step(model, forward, optimizer, after_step=after_step, name=name)


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
