"""SchedulerConfig.embeddings: whether a model's input embedding table trains at all.

A causal LM's input embedding is the largest single weight (Qwen2.5-0.5B: 136M of 494M parameters, a 152k x 896
table, tied to its LM head), and a step that trains it holds a gradient and AdamW moments of its size. Held
frozen for the run ("freeze"), it costs neither: ``slimfit plan`` puts Qwen2.5-0.5B bf16 b1 s1024 under the
defaults at 2.0 GiB instead of 2.4 (docs/fidelity.md, "The input embedding of a causal LM"). A head tied to the
table is the same parameter, so it is held too; an untied head is not (the scheduler schedules it like any
weight matrix).

"auto" (the default) is "freeze" for a causal LM (the decoder protocols decided it) and "train" for any other
model: an encoder's table is a small share of it and its task protocols were measured with it trained.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from .candidates import is_causal_lm, unwrap_model

__all__ = ["EMBEDDINGS", "AUTO_EMBEDDINGS", "resolve_embeddings", "held_embeddings"]

AUTO_EMBEDDINGS = "auto"
EMBEDDINGS = (AUTO_EMBEDDINGS, "train", "freeze")


def resolve_embeddings(value: str, module: Optional[nn.Module], kinds: tuple, layers) -> str:
    """SchedulerConfig.embeddings against the model: "auto" is "freeze" for a causal LM whose embeddings are not
    scheduled (``kinds``) and whose layers are not listed (``layers``), else "train"; "freeze" without a model
    that has an input embedding is a ValueError that says what to do instead."""
    if value == AUTO_EMBEDDINGS:
        auto = module is not None and layers is None and "embedding" not in kinds and is_causal_lm(module) \
            and _input_embedding(module) is not None
        return "freeze" if auto else "train"
    if value == "freeze" and (module is None or _input_embedding(module) is None):
        raise ValueError('ILSScheduler(embeddings="freeze") needs a model with get_input_embeddings() (a transformers '
                         "model); for a parameter list or another module, set requires_grad_(False) on the table "
                         "before building the optimizer and the scheduler")
    return value


def held_embeddings(module: nn.Module, candidates: list) -> list:
    """The (name, parameter) pairs held frozen by embeddings="freeze": the input embedding table (and so a head
    tied to it), named as among ``candidates`` (the trainable weights; empty when the table is frozen already)."""
    table = _input_embedding(module)
    return [(n, p) for n, p in candidates if p is table]


def _input_embedding(module: nn.Module):
    """The input embedding's weight of a transformers model (through PEFT, compile and DDP wrappers), or None."""
    model = unwrap_model(module)
    get = getattr(model, "get_input_embeddings", None)
    if not callable(get):
        return None
    try:
        emb = get()
    except (NotImplementedError, AttributeError):
        return None
    weight = getattr(emb, "weight", None)
    return weight if isinstance(weight, nn.Parameter) else None
