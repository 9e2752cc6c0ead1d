"""SchedulerConfig.embeddings: whether a model's input embedding table trains at all.

A causal LM's input embedding is the largest single weight (Qwen2.5-0.5B: 136M of 494M parameters, a 152k x 896
table, tied to its LM head), and a step that trains it holds a gradient and AdamW moments of its size. Held
frozen for the run ("freeze"), it costs neither: ``slimfit plan`` puts Qwen2.5-0.5B bf16 b1 s1024 under the
defaults at 1.99 GiB instead of 2.38. A head tied to the table is the same parameter, so it is held too; an untied
head is not (the scheduler schedules it like any weight matrix).

"train" is the default: held with its tied head, the table cost the many-answer decoder protocol 1.04 points and
4.3% of held-out loss against full fine-tuning (the two-answer one nothing): docs/fidelity.md, "The input
embedding of a causal LM".
"""
from __future__ import annotations

from torch import nn

from .candidates import unwrap_model

__all__ = ["EMBEDDINGS", "check_embeddings", "held_embeddings"]

EMBEDDINGS = ("train", "freeze")


def check_embeddings(value: str, module: nn.Module | None) -> str:
    """``value``, or a ValueError that says what to do instead: "freeze" needs a model with an input embedding."""
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
