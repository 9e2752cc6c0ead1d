"""Activation-memory estimates per layer, and the budget mode.

An estimate says, for each candidate layer, how many activation bytes training it costs
(equivalently: how many bytes freezing it saves), e.g. a Linear's input, which is saved
for the weight gradient only. The scheduler takes it as

* a dict ``{layer name: bytes}`` (layers left out cost 0 bytes; unknown names are an error), or
* a callable ``fn(name, parameter) -> bytes``.

``estimate_activation_bytes(model, *inputs)`` measures one forward pass with hooks
(Linear/Conv input bytes; norm weights a chosen fraction of their input) and is a good
default for a plain model.

Budget mode (``budget_bytes``): every step the trained set is chosen so that
``base_bytes + sum(bytes of trained layers) <= budget_bytes``; ``freeze_rate`` is then a
lower bound on the fraction frozen, and the effective rate is whatever the budget needs.
``min_rate_for_budget`` gives one fixed rate that meets the budget whichever layers train.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from .candidates import is_norm_module, unwrap_model

__all__ = ["ActivationBytes", "resolve_activation_bytes", "check_budget", "min_rate_for_budget",
           "estimate_activation_bytes"]

ActivationBytes = Union[Mapping[str, float], Callable[[str, nn.Parameter], float]]


def resolve_activation_bytes(spec: ActivationBytes, layers: Sequence[tuple[str, nn.Parameter]],
                             unscheduled: Sequence[tuple[str, nn.Parameter]] = ()) -> tuple[torch.Tensor, float]:
    """(bytes of each scheduled layer as a float64 tensor in layer order, total bytes of the
    ``unscheduled`` candidates). Those train every step (scheduled_kinds, always_train), so their
    bytes belong with the base; naming them in a dict is fine (estimate_activation_bytes does)."""
    every = list(layers) + list(unscheduled)
    names = [n for n, _ in every]
    if callable(spec) and not isinstance(spec, Mapping):
        vals = [spec(n, p) for n, p in every]
    elif isinstance(spec, Mapping):
        known = set(names)
        unknown = [k for k in spec if k not in known]
        if unknown:
            raise ValueError(
                f"activation_bytes names {len(unknown)} parameter(s) that are not candidate layers, "
                f"e.g. {unknown[:3]}; candidates look like {names[:3]}")
        vals = [spec.get(n, 0) for n in names]
    else:
        raise TypeError("activation_bytes must be a dict {layer name: bytes} or a callable (name, param) -> bytes")
    out = []
    for n, v in zip(names, vals):
        v = float(v)
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"activation_bytes[{n!r}] must be a finite number >= 0, got {v!r}")
        out.append(v)
    return torch.tensor(out[:len(layers)], dtype=torch.float64), float(sum(out[len(layers):]))


def check_budget(bytes_: torch.Tensor, budget_bytes: float, base_bytes: float, names: Sequence[str]) -> None:
    """Raise ValueError unless at least one layer can train within the budget."""
    if not math.isfinite(float(budget_bytes)) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive number, got {budget_bytes!r}")
    if base_bytes < 0:
        raise ValueError(f"base_bytes must be >= 0, got {base_bytes!r}")
    room = budget_bytes - base_bytes
    cheapest = float(bytes_.min())
    if room < cheapest:
        i = int(torch.argmin(bytes_))
        raise ValueError(
            f"budget_bytes={budget_bytes:.4g} cannot be met: base_bytes={base_bytes:.4g} plus the cheapest "
            f"layer ({names[i]!r}, {cheapest:.4g} bytes) already exceeds it, so not a single layer could "
            "train. Raise the budget, lower base_bytes, or compress activations further.")


def min_rate_for_budget(bytes_: Union[Sequence[float], torch.Tensor, Mapping[str, float]],
                        budget_bytes: float, base_bytes: float = 0.0) -> float:
    """The smallest freeze rate such that ANY choice of trained layers fits the budget
    (worst case: the most expensive layers train). Raises ValueError if none does."""
    if isinstance(bytes_, Mapping):
        bytes_ = list(bytes_.values())
    b = sorted((float(x) for x in (bytes_.tolist() if isinstance(bytes_, torch.Tensor) else bytes_)),
               reverse=True)
    n = len(b)
    room = budget_bytes - base_bytes
    k = 0  # how many of the most expensive layers fit together
    used = 0.0
    for x in b:
        if used + x > room:
            break
        used += x
        k += 1
    if k == 0:
        raise ValueError(f"budget_bytes={budget_bytes:.4g} leaves room for no layer (base_bytes={base_bytes:.4g}, "
                         f"most expensive layer {b[0] if b else 0:.4g} bytes)")
    # Frozen count n - k must be reached by round(rate * n): rate = (n - k) / n suffices.
    return (n - k) / n


@torch.no_grad()
def estimate_activation_bytes(model: nn.Module, *args, norm_fraction: float = 0.0,
                              layers: Optional[Sequence[tuple[str, nn.Parameter]]] = None,
                              **kwargs) -> dict[str, int]:
    """Run one forward pass and record, per candidate layer, the bytes its input takes.

    Linear and Conv weights: the input of the module (what autograd keeps for the weight
    gradient; a frozen layer does not need it). Norm weights: ``norm_fraction`` times the
    input bytes (0 for plain PyTorch, whose LayerNorm keeps its input either way; SlimFit's
    patched LayerNorm keeps ~10% of it when frozen, i.e. 0.9). Other layers (embeddings,
    position embeddings, class tokens): 0.
    """
    from .candidates import find_candidates

    base = unwrap_model(model)
    cand = layers if layers is not None else find_candidates(base)
    by_id = {id(p): n for n, p in cand}
    sizes: dict[str, int] = {n: 0 for n, _ in cand}
    handles = []

    def make_hook(mod: nn.Module, kind: str):
        def hook(m, inputs):
            x = inputs[0] if inputs else None
            if not isinstance(x, torch.Tensor):
                return
            nbytes = x.numel() * x.element_size()
            w = getattr(m, "weight", None)
            if w is not None and id(w) in by_id:
                f = 1.0 if kind == "mm" else norm_fraction
                sizes[by_id[id(w)]] += int(nbytes * f)
        return hook

    for mod in base.modules():
        if isinstance(mod, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)) or type(mod).__name__ == "Conv1D":
            handles.append(mod.register_forward_pre_hook(make_hook(mod, "mm")))
        elif is_norm_module(mod):
            handles.append(mod.register_forward_pre_hook(make_hook(mod, "norm")))
    try:
        model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return sizes
