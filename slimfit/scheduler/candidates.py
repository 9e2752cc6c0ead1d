"""Which parameters are "layers" that the scheduler may freeze.

SlimFit's rule (as its research code runs it): every parameter with more than one
dimension (Linear / Embedding / Conv weights, position embeddings, class tokens) plus the
weight of every normalisation layer (LayerNorm, RMSNorm, ... : any module whose class name
contains ``Norm``). Biases are never candidates, nor any other 1-D parameter.

Parameters that do not require grad when the scheduler is built (for instance the base
weights of a LoRA model) are left alone: they are not candidates and stay frozen.

Input is a module or an iterable of ``(name, parameter)`` pairs. With pairs there are no
module classes to look at, so a 1-D ``weight`` counts as a norm weight when its owner's
name looks like a norm (contains ``norm``, or is ``ln`` / starts with ``ln_``); pass the
module whenever you can.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Sequence, Union

import torch
from torch import nn

__all__ = ["find_candidates", "unwrap_model", "resolve_layers", "is_norm_module", "drop_always_trained",
           "task_head_names", "find_task_heads", "default_task_head", "TASK_HEAD", "candidate_kinds", "KINDS",
           "keep_kinds", "is_causal_lm"]

# always_train="task_head": the freshly initialised head of a Hugging Face task model. These are
# the attribute names transformers gives it on *ForSequenceClassification / *ForImageClassification /
# *ForTokenClassification / *ForQuestionAnswering / *ForMultipleChoice (an LM head is pretrained: not listed).
TASK_HEAD = "task_head"
TASK_HEAD_MODULES = ("classifier", "score", "qa_outputs")

NamedParams = Sequence[tuple[str, nn.Parameter]]

# The kinds of candidate (candidate_kinds); ILSScheduler(scheduled_kinds=...) schedules some of them.
KINDS = ("matmul", "norm", "embedding")
_EMBEDDING_OWNER = re.compile(r"(embed|_token$|^cls_token$|^pos_)", re.IGNORECASE)

_NORM_OWNER = re.compile(r"(norm|^ln$|^ln_|^ln\d)", re.IGNORECASE)


def is_norm_module(module: nn.Module) -> bool:
    """True for LayerNorm, RMSNorm, LlamaRMSNorm, T5LayerNorm, GroupNorm, ..."""
    return "Norm" in type(module).__name__


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel / DataParallel wrappers (names then match
    the plain model, so a scheduler state moves between DDP and single-process runs)."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


def _module_candidates(model: nn.Module, include_frozen: bool) -> list[tuple[str, nn.Parameter]]:
    out: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for mod_name, module in model.named_modules(remove_duplicate=False):
        norm = is_norm_module(module)
        for p_name, p in module.named_parameters(recurse=False):
            if p is None or id(p) in seen:
                continue
            if p.dim() > 1 or (norm and p_name == "weight" and p.dim() == 1):
                if p.requires_grad or include_frozen:
                    seen.add(id(p))
                    out.append((f"{mod_name}.{p_name}" if mod_name else p_name, p))
    # Keep the model's own parameter order (named_parameters order), which is stable.
    order = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    out.sort(key=lambda np_: order.get(id(np_[1]), len(order)))
    return out


def _looks_like_norm_weight(name: str) -> bool:
    parts = name.split(".")
    if len(parts) < 2 or parts[-1] != "weight":
        return False
    return bool(_NORM_OWNER.search(parts[-2]))


def _pairs(named: Iterable) -> list[tuple[str, nn.Parameter]]:
    if isinstance(named, (str, torch.Tensor)) or not isinstance(named, Iterable):
        raise TypeError(f"expected a module or (name, parameter) pairs such as model.named_parameters(); got "
                        f"{type(named).__name__}")
    pairs: list[tuple[str, nn.Parameter]] = []
    names: set[str] = set()
    ids: set[int] = set()
    for item in named:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError(
                "expected a module or (name, parameter) pairs such as model.named_parameters(); "
                f"got an element of type {type(item).__name__}. Plain model.parameters() has no "
                "names: pass model.named_parameters() or the model itself.")
        name, p = item
        if name in names:
            raise ValueError(f"parameter name {name!r} appears twice in the parameter list")
        names.add(name)
        if id(p) in ids:  # tied weights under two names: keep the first, like named_parameters
            continue
        ids.add(id(p))
        pairs.append((name, p))
    return pairs


def find_candidates(model_or_named_params: Union[nn.Module, Iterable],
                    include_frozen: bool = False) -> list[tuple[str, nn.Parameter]]:
    """The candidate layers as ``[(name, parameter), ...]`` in model order.

    Raises ValueError when there are none (a model without weights, or all frozen).
    """
    if isinstance(model_or_named_params, nn.Module):
        model = unwrap_model(model_or_named_params)
        out = _module_candidates(model, include_frozen)
        what = type(model).__name__
    else:
        pairs = _pairs(model_or_named_params)
        out = [(n, p) for n, p in pairs
               if (p.requires_grad or include_frozen)
               and (p.dim() > 1 or (p.dim() == 1 and _looks_like_norm_weight(n)))]
        what = "the parameter list"
    if not out:
        raise ValueError(
            f"no candidate layers in {what}: the scheduler freezes parameters with more than one "
            "dimension and norm-layer weights that require grad, and found none")
    return out


def resolve_layers(model: nn.Module, layers: Iterable) -> list[tuple[str, nn.Parameter]]:
    """Check an explicit layer list against ``model``: names (or (name, parameter) pairs)
    must name parameters of the model, and given parameters must be the model's own."""
    model = unwrap_model(model)
    own = dict(model.named_parameters(remove_duplicate=False))
    out: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for item in layers:
        if isinstance(item, str):
            name, p = item, None
        elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str):
            name, p = item
        else:
            raise TypeError(f"layers: expected parameter names or (name, parameter) pairs, got {item!r:.80}")
        if name not in own:
            raise ValueError(
                f"layers: {name!r} is not a parameter of {type(model).__name__} "
                f"(it has {len(own)} parameters, e.g. {list(own)[:3]})")
        if p is not None and p is not own[name]:
            raise ValueError(
                f"layers: the parameter given as {name!r} is not the model's parameter of that name "
                "(the parameter list does not match the model)")
        if id(own[name]) in seen:
            continue
        seen.add(id(own[name]))
        out.append((name, own[name]))
    if not out:
        raise ValueError("layers: the explicit layer list is empty")
    return out


def _is_embedding_module(module: nn.Module) -> bool:
    """nn.Embedding / nn.EmbeddingBag, or a module whose class says it holds embeddings
    (ViTEmbeddings, Dinov2Embeddings: position embeddings, class / mask / register tokens)."""
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or "Embedding" in type(module).__name__


def candidate_kinds(model: nn.Module | None, named: NamedParams) -> dict[str, str]:
    """The kind of each candidate: ``"norm"`` (a norm layer's weight), ``"embedding"`` (an
    embedding table, position embedding or token that no other kind of module also uses: a
    table tied to an LM head is a matmul weight) or ``"matmul"`` (Linear / Conv / Conv1D weights
    and anything else). The kinds differ in what training them costs: only a matmul weight's
    gradient needs a saved input the size of the activations.

    Without a model (a parameter list) the names decide: a norm weight as in find_candidates;
    an embedding when the owner's or the parameter's name contains ``embed`` or ends in
    ``_token`` (a tied table then counts as an embedding: pass the model)."""
    if model is None:
        return {name: _kind_from_name(name, p) for name, p in named}
    model = unwrap_model(model)
    owners: dict[int, list[nn.Module]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for _, p in module.named_parameters(recurse=False):
            if p is not None:
                owners.setdefault(id(p), []).append(module)
    kinds = {}
    for name, p in named:
        mods = owners.get(id(p), [])
        if mods and all(is_norm_module(m) for m in mods):
            kinds[name] = "norm"
        elif mods and all(_is_embedding_module(m) for m in mods):
            kinds[name] = "embedding"
        else:
            kinds[name] = "matmul"
    return kinds


def _kind_from_name(name: str, p: torch.Tensor) -> str:
    if p.dim() == 1 and _looks_like_norm_weight(name):
        return "norm"
    parts = name.split(".")
    if any(_EMBEDDING_OWNER.search(part) for part in parts[-2:]):
        return "embedding"
    return "matmul"


def keep_kinds(named: NamedParams, kinds: dict[str, str], scheduled: Sequence[str]) -> list[tuple[str, nn.Parameter]]:
    """``named`` restricted to the kinds in ``scheduled``; ValueError when nothing is left."""
    kept = [(n, p) for n, p in named if kinds[n] in scheduled]
    if not kept:
        present = sorted(set(kinds.values()))
        raise ValueError(f"scheduled_kinds={tuple(scheduled)} leaves no layer to schedule: the candidates are of "
                         f"kinds {present}")
    return kept


# Wrappers between the model a user holds and the task model with the head: PEFT (base_model.model),
# torch.compile (_orig_mod), DDP / DataParallel (module).
_WRAPPER_CHILDREN = ("module", "_orig_mod", "base_model", "model")


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` (or a module inside it: PEFT, compile and DDP wrappers) is a causal language model:
    a transformers class named *ForCausalLM or *LMHeadModel (GPT-2's), or any module with an ``lm_head`` and
    ``generate`` (warmup_steps="auto" ramps the rate for these)."""
    for module in model.modules():
        name = type(module).__name__
        if name.endswith(("ForCausalLM", "LMHeadModel")):
            return True
        if hasattr(module, "lm_head") and callable(getattr(module, "generate", None)):
            return True
    return False


def find_task_heads(model: nn.Module) -> list[str]:
    """Names (as in ``model.named_parameters()``) of the task-head modules of ``model``: children named
    as in TASK_HEAD_MODULES that hold parameters, looked up through wrapper children (PEFT's
    ``base_model.model``, torch.compile's ``_orig_mod``, DDP's ``module``); empty when there is none."""
    prefix, module = "", model
    while True:
        heads = [prefix + name for name, child in module.named_children()
                 if name in TASK_HEAD_MODULES and any(True for _ in child.parameters())]
        if heads:
            return heads
        inner = next(((n, c) for n, c in module.named_children() if n in _WRAPPER_CHILDREN), None)
        if inner is None:
            return []
        prefix, module = prefix + inner[0] + ".", inner[1]


def task_head_names(model: nn.Module) -> list[str]:
    """``find_task_heads`` of the unwrapped model; ValueError when there is none, so a model without a
    head is not silently scheduled whole (``always_train="task_head"``)."""
    model = unwrap_model(model)
    heads = find_task_heads(model)
    if not heads:
        raise ValueError(
            f'always_train="task_head": {type(model).__name__} has no task head (a child module named one of '
            f"{TASK_HEAD_MODULES}); name the head's module instead, e.g. always_train=['head'], or leave it out")
    return heads


def default_task_head(model: nn.Module, named: NamedParams) -> list[str]:
    """The scheduler's default ``always_train``: the task heads of ``model`` that hold scheduled layers
    (``named``), unless they are all there is to schedule; empty for a model without a head (a bare
    encoder, a causal LM, a custom module): nothing is left out."""
    heads = [h for h in find_task_heads(unwrap_model(model))
             if any(n == h or n.startswith(h + ".") for n, _ in named)]
    if heads and all(any(n == h or n.startswith(h + ".") for h in heads) for n, _ in named):
        return []
    return heads


def drop_always_trained(named: list[tuple[str, nn.Parameter]],
                        always_train: Iterable[str]) -> list[tuple[str, nn.Parameter]]:
    """``named`` without the parameters under the module prefixes in ``always_train`` (e.g.
    ``["classifier"]``): those stay out of scheduling and train every step. A freshly
    initialised task head is the usual case: frozen most of a short run, it trains too little.
    Each prefix must match a candidate, so a typo cannot silently schedule the head."""
    if isinstance(always_train, str):
        always_train = [always_train]
    prefixes = list(always_train)
    if not prefixes:
        return named

    def under(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    for prefix in prefixes:
        if not isinstance(prefix, str) or not prefix:
            raise TypeError(f"always_train: expected module or parameter names, got {prefix!r}")
        if not any(under(n, prefix) for n, _ in named):
            raise ValueError(
                f"always_train: {prefix!r} matches none of the {len(named)} scheduled layers "
                f"(e.g. {[n for n, _ in named[-3:]]}); give a module name such as 'classifier'")
    kept = [(n, p) for n, p in named if not any(under(n, q) for q in prefixes)]
    if not kept:
        raise ValueError("always_train covers every candidate layer: nothing is left to schedule")
    return kept
