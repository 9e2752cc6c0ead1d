"""Which model a memory measurement or a plan is about: the reference architectures, built from their
`transformers` config with random weights (nothing downloaded: the bytes a step keeps do not depend on the
weights' values) with a random batch for each, and ModelRef, the model a plan is about (an architecture, a
transformers config object, a config.json or a folder holding one, or a hub id whose config is already in the
local cache).

    from slimfit.memory import models
    model = models.build("bert-base", seed=0)                            # train mode, sdpa attention
    inputs = models.make_inputs(model, models.resolve("bert-base").task, batch=2, seq_len=128)
    ref = models.resolve_model("./config.json")                          # a plan's model, read offline

`resolve(name)` accepts the names `slimfit memory --help` lists, aliases (bert, vit, gpt2-small, smollm2,
tinyllama, ...) and the hidden test sizes (bert-tiny, llama-tiny). Nothing is downloaded for a ModelRef
either: `slimfit plan` must answer before the run, on a machine that may have no network, so a hub id resolves
only when `transformers` finds its config offline (`local_files_only=True`). slimfit/memory/runs.py freezes,
primes and measures these models.
"""
from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ARCHITECTURES", "Architecture", "TEXT_CLS", "CAUSAL_LM", "IMAGE_CLS", "known_names", "resolve", "build",
           "max_tokens", "make_inputs", "ModelRef", "resolve_model", "build_model", "make_batch", "ENCODER_TYPES"]

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

# Shared by the published Qwen2.5 and Llama 3 configs (config.json on the hub): vocabulary, rope, norms.
_QWEN25 = dict(vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", bos_token_id=151643,
               eos_token_id=151643, use_sliding_window=False, sliding_window=None, attention_dropout=0.0)
_LLAMA3 = dict(vocab_size=128256, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
               rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=128000, eos_token_id=128001, mlp_bias=False,
               attention_bias=False)
_LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)

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
                 "Llama layout, small: 4 layers, hidden 256, GQA 8/2 heads, vocab 8000 (docs/decoders.md's decoder, "
                 "10M)"),
    Architecture("tinyllama-1.1b", CAUSAL_LM, "LlamaConfig", "LlamaForCausalLM",
                 dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                      rms_norm_eps=1e-5),
                 "Llama layout, TinyLlama-1.1B sizes: 22 layers, hidden 2048 "
                 "(1.1B: ~10 GiB of memory in fp32, weights + gradients)"),
    # The decoders people fine-tune (issue 40): their published config.json hyperparameters, random weights.
    Architecture("qwen2.5-0.5b", CAUSAL_LM, "Qwen2Config", "Qwen2ForCausalLM",
                 dict(_QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2, max_position_embeddings=32768, max_window_layers=24,
                      tie_word_embeddings=True),
                 "Qwen2.5-0.5B: 24 layers, hidden 896, GQA 14/2 heads, vocab 151,936 tied (494M)"),
    Architecture("qwen2.5-1.5b", CAUSAL_LM, "Qwen2Config", "Qwen2ForCausalLM",
                 dict(_QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                      num_key_value_heads=2, max_position_embeddings=131072, max_window_layers=21,
                      tie_word_embeddings=True),
                 "Qwen2.5-1.5B: 28 layers, hidden 1536, GQA 12/2 heads, vocab 151,936 tied (1.5B)"),
    Architecture("qwen2.5-7b", CAUSAL_LM, "Qwen2Config", "Qwen2ForCausalLM",
                 dict(_QWEN25, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                      num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
                      max_window_layers=28, tie_word_embeddings=False),
                 "Qwen2.5-7B: 28 layers, hidden 3584, GQA 28/4 heads, vocab 152,064 untied (7.6B)"),
    Architecture("llama-3.2-1b", CAUSAL_LM, "LlamaConfig", "LlamaForCausalLM",
                 dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      head_dim=64, rope_scaling=dict(_LLAMA3_ROPE, factor=32.0), tie_word_embeddings=True),
                 "Llama-3.2-1B: 16 layers, hidden 2048, GQA 32/8 heads, vocab 128,256 tied (1.24B)"),
    Architecture("llama-3.2-3b", CAUSAL_LM, "LlamaConfig", "LlamaForCausalLM",
                 dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                      head_dim=128, rope_scaling=dict(_LLAMA3_ROPE, factor=32.0), tie_word_embeddings=True),
                 "Llama-3.2-3B: 28 layers, hidden 3072, GQA 24/8 heads, vocab 128,256 tied (3.2B)"),
    Architecture("llama-3.1-8b", CAUSAL_LM, "LlamaConfig", "LlamaForCausalLM",
                 dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      head_dim=128, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0), tie_word_embeddings=False),
                 "Llama-3.1-8B: 32 layers, hidden 4096, GQA 32/8 heads, vocab 128,256 untied (8.0B)"),
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
            "smollm": "smollm-135m", "smollm2": "smollm2-135m", "tinyllama": "tinyllama-1.1b",
            "qwen2.5-0.5": "qwen2.5-0.5b", "llama-3-8b": "llama-3.1-8b", "llama3.1-8b": "llama-3.1-8b",
            "llama3.2-1b": "llama-3.2-1b", "llama3.2-3b": "llama-3.2-3b"}


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
    """The model of `arch` with random weights (seeded), in train mode: build_model of its ModelRef (one way
    to build a model; the same weights bit for bit as the config built with these overrides)."""
    arch = resolve(arch) if isinstance(arch, str) else arch
    return build_model(_from_architecture(arch), attn=attn_implementation, image_size=image_size, seed=seed,
                       num_labels=num_labels)


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


# ------------------------------------------------------------------ the model a plan is about
# model_type values that are encoders (a sequence-classification head) when a config names no architecture.
ENCODER_TYPES = {"bert", "roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "xlm-roberta",
                 "mpnet", "camembert", "modernbert"}
_TASK_SUFFIX = {"ForCausalLM": CAUSAL_LM, "LMHeadModel": CAUSAL_LM,
                "ForImageClassification": IMAGE_CLS, "ForSequenceClassification": TEXT_CLS}
_AUTO = {CAUSAL_LM: "AutoModelForCausalLM", TEXT_CLS: "AutoModelForSequenceClassification",
         IMAGE_CLS: "AutoModelForImageClassification"}


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """A model to plan for: its config (a template, copied for every build), task and how it was found."""

    name: str
    task: str                   # TEXT_CLS | CAUSAL_LM | IMAGE_CLS
    config: Any                 # a transformers PretrainedConfig
    model_class: str = ""       # a transformers class name; "" = the task's Auto class
    source: str = "architecture"  # architecture | config | file | hub cache

    @property
    def model_type(self) -> str:
        """The config's model_type (bert, llama, ...), which picks LoRA's default target modules."""
        return getattr(self.config, "model_type", "")


def _task_of(config) -> str:
    """The task of a config: from its `architectures` (LlamaForCausalLM -> causal LM), else its model type."""
    for name in getattr(config, "architectures", None) or ():
        for suffix, task in _TASK_SUFFIX.items():
            if name.endswith(suffix):
                return task
    model_type = getattr(config, "model_type", "")
    if hasattr(config, "patch_size") and hasattr(config, "image_size"):
        return IMAGE_CLS
    return TEXT_CLS if model_type in ENCODER_TYPES else CAUSAL_LM


def _from_architecture(arch: Architecture) -> ModelRef:
    """The ModelRef of a reference architecture (its config class with its overrides)."""
    import transformers

    config = getattr(transformers, arch.config_class)(**arch.config)
    return ModelRef(arch.name, arch.task, config, arch.model_class, "architecture")


def _from_hub_cache(name: str) -> ModelRef:
    """A hub id or a path, read offline; ValueError that says what was tried."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:
        known = ", ".join(known_names())
        raise ValueError(
            f"{name!r} is not an architecture of slimfit.architectures ({known}), not a config.json or a folder "
            f"holding one, and not a hub id whose config is in the local cache (slimfit plan reads configs offline, "
            f"local_files_only=True: fetch it once with `python -c \"from transformers import AutoConfig; "
            f"AutoConfig.from_pretrained('{name}')\"` where there is network, or pass its config.json) "
            f"[{type(exc).__name__}: {str(exc).splitlines()[0][:160]}]") from None
    return ModelRef(name, _task_of(config), config, "", "file" if os.path.exists(name) else "hub cache")


def resolve_model(model, task: str | None = None) -> ModelRef:
    """A ModelRef for an architecture name, a transformers config, a ModelRef, a config path or a cached hub id.
    `task` overrides the task the config implies (text-classification, causal-lm, image-classification)."""
    if isinstance(model, ModelRef):
        ref = model
    elif isinstance(model, Architecture):
        ref = _from_architecture(model)
    elif isinstance(model, str):
        try:
            ref = _from_architecture(resolve(model))
        except ValueError:
            ref = _from_hub_cache(model)
    elif hasattr(model, "to_dict") and hasattr(model, "model_type"):
        ref = ModelRef(getattr(model, "name_or_path", "") or model.model_type, _task_of(model), model, "", "config")
    else:
        raise TypeError(f"model must be an architecture name, a hub id, a config path or a transformers config; "
                        f"got {type(model).__name__}")
    if task is not None and task != ref.task:
        if task not in _AUTO:
            raise ValueError(f"task must be one of {sorted(_AUTO)}, got {task!r}")
        ref = dataclasses.replace(ref, task=task, model_class="")
    return ref


def _config_for(ref: ModelRef, layers: int | None, image_size: int | None, num_labels: int = 2):
    """A copy of the ref's config with the build's overrides (depth, image size, labels)."""
    config = copy.deepcopy(ref.config)
    if layers is not None:
        for key in ("num_hidden_layers", "n_layer", "n_layers"):
            if hasattr(config, key):
                setattr(config, key, layers)
                break
    if ref.task == IMAGE_CLS and image_size is not None:
        config.image_size = image_size
    if ref.task != CAUSAL_LM:
        config.num_labels = num_labels
    return config


def build_model(ref: ModelRef, *, attn: str = "sdpa", layers: int | None = None, image_size: int | None = None,
                seed: int = 0, init: bool = True, dtype: str = "float32", num_labels: int = 2):
    """The model of `ref` from its config, seeded random weights, train mode, `attn` attention, its parameters
    and buffers in `dtype` (a torch dtype name: bfloat16 holds the model as from_pretrained(torch_dtype=...)
    does), `num_labels` classes for a classifier. Under a FakeTensorMode the parameters are fake: nothing is
    allocated (init=False skips the weight initialisation, whose values fake tensors do not have: rejection
    loops read them)."""
    import contextlib

    import torch
    import transformers
    from transformers.initialization import no_init_weights

    config = _config_for(ref, layers, image_size, num_labels)
    torch.manual_seed(seed)
    with contextlib.nullcontext() if init else no_init_weights():
        if ref.model_class:
            model = getattr(transformers, ref.model_class)(config)
        else:
            model = getattr(transformers, _AUTO[ref.task]).from_config(config)
    if not init:
        model.tie_weights()  # no_init_weights skips init_weights, which ties the embeddings and the LM head
    if dtype != "float32":
        model.to(getattr(torch, dtype))
    model.set_attn_implementation(attn)
    model.train()
    return model


def make_batch(model, ref: ModelRef, batch: int, seq: int | None, image_size: int | None, seed: int = 0) -> dict:
    """A random batch with labels (make_inputs): token ids, an all-ones attention mask, labels;
    or pixel values and labels."""
    return make_inputs(model, ref.task, batch, seq or 1, image_size, seed=seed)
