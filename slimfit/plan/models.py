"""Which model a plan is about: an architecture name of slimfit.architectures, a transformers config (an
object, a config.json or a folder holding one), or a hub id whose config is already in the local cache.

Nothing is downloaded: `slimfit plan` must answer before the run, on a machine that may have no network,
so a hub id resolves only when `transformers` finds its config offline (`local_files_only=True`). The
weights are never needed: memory does not depend on their values, and the model is built from its config
(random weights, or fake tensors when predicting).
"""
from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

from .. import architectures as archs

__all__ = ["ModelRef", "resolve_model", "build_model", "make_batch", "ENCODER_TYPES"]

# model_type values that are encoders (a sequence-classification head) when a config names no architecture.
ENCODER_TYPES = {"bert", "roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "xlm-roberta",
                 "mpnet", "camembert", "modernbert"}
_TASK_SUFFIX = {"ForCausalLM": archs.CAUSAL_LM, "LMHeadModel": archs.CAUSAL_LM,
                "ForImageClassification": archs.IMAGE_CLS, "ForSequenceClassification": archs.TEXT_CLS}
_AUTO = {archs.CAUSAL_LM: "AutoModelForCausalLM", archs.TEXT_CLS: "AutoModelForSequenceClassification",
         archs.IMAGE_CLS: "AutoModelForImageClassification"}


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """A model to plan for: its config (a template, copied for every build), task and how it was found."""

    name: str
    task: str                   # architectures.TEXT_CLS | CAUSAL_LM | IMAGE_CLS
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
        return archs.IMAGE_CLS
    return archs.TEXT_CLS if model_type in ENCODER_TYPES else archs.CAUSAL_LM


def _from_architecture(arch: archs.Architecture) -> ModelRef:
    """The ModelRef of an architecture of slimfit.architectures (its config class with its overrides)."""
    import transformers

    config = getattr(transformers, arch.config_class)(**arch.config)
    return ModelRef(arch.name, arch.task, config, arch.model_class, "architecture")


def _from_hub_cache(name: str) -> ModelRef:
    """A hub id or a path, read offline; ValueError that says what was tried."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:
        known = ", ".join(archs.known_names())
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
    elif isinstance(model, archs.Architecture):
        ref = _from_architecture(model)
    elif isinstance(model, str):
        try:
            ref = _from_architecture(archs.resolve(model))
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


def _config_for(ref: ModelRef, layers: int | None, image_size: int | None):
    """A copy of the ref's config with the build's overrides (depth, image size, labels)."""
    config = copy.deepcopy(ref.config)
    if layers is not None:
        for key in ("num_hidden_layers", "n_layer", "n_layers"):
            if hasattr(config, key):
                setattr(config, key, layers)
                break
    if ref.task == archs.IMAGE_CLS and image_size is not None:
        config.image_size = image_size
    if ref.task != archs.CAUSAL_LM:
        config.num_labels = 2
    return config


def build_model(ref: ModelRef, *, attn: str = "sdpa", layers: int | None = None, image_size: int | None = None,
                seed: int = 0, init: bool = True):
    """The model of `ref` from its config, seeded random weights, train mode, `attn` attention. Under a
    FakeTensorMode the parameters are fake: nothing is allocated (init=False skips the weight
    initialisation, whose values fake tensors do not have: rejection loops read them)."""
    import contextlib

    import torch
    import transformers
    from transformers.initialization import no_init_weights

    config = _config_for(ref, layers, image_size)
    torch.manual_seed(seed)
    with contextlib.nullcontext() if init else no_init_weights():
        if ref.model_class:
            model = getattr(transformers, ref.model_class)(config)
        else:
            model = getattr(transformers, _AUTO[ref.task]).from_config(config)
    if not init:
        model.tie_weights()  # no_init_weights skips init_weights, which ties the embeddings and the LM head
    model.set_attn_implementation(attn)
    model.train()
    return model


def make_batch(model, ref: ModelRef, batch: int, seq: int | None, image_size: int | None, seed: int = 0) -> dict:
    """A random batch with labels (architectures.make_inputs): token ids, an all-ones attention mask, labels;
    or pixel values and labels."""
    return archs.make_inputs(model, ref.task, batch, seq or 1, image_size, seed=seed)
