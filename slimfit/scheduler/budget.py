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
import numbers
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

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
    out = [_byte_count(f"activation_bytes[{n!r}]", v) for n, v in zip(names, vals)]
    return torch.tensor(out[:len(layers)], dtype=torch.float64), float(sum(out[len(layers):]))


def _byte_count(what: str, value) -> float:
    """``value`` as a float of bytes: a finite number >= 0 (or a one-element tensor of one), else a
    ValueError naming ``what``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number of bytes >= 0, got {type(value).__name__} {value!r:.60}; "
                         "estimate_activation_bytes(model, batch) measures them")
    return float(value)


def check_budget(bytes_: torch.Tensor, budget_bytes: float, base_bytes: float, names: Sequence[str]) -> None:
    """Raise ValueError unless at least one layer can train within the budget."""
    _check_budget_args(budget_bytes, base_bytes)
    room = budget_bytes - base_bytes
    cheapest = float(bytes_.min())
    if room < cheapest:
        i = int(torch.argmin(bytes_))
        raise ValueError(
            f"budget_bytes={budget_bytes:.4g} cannot be met: base_bytes={base_bytes:.4g} plus the cheapest "
            f"layer ({names[i]!r}, {cheapest:.4g} bytes) already exceeds it, so not a single layer could "
            "train. Raise the budget, lower base_bytes, or compress activations further.")


def _check_budget_args(budget_bytes, base_bytes) -> None:
    """budget_bytes a finite number > 0, base_bytes a finite number >= 0 (ValueError naming the argument)."""
    for name, value, low in (("budget_bytes", budget_bytes, "> 0"), ("base_bytes", base_bytes, ">= 0")):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
                or value < 0 or (low == "> 0" and value == 0):
            raise ValueError(f"{name} must be a finite number of bytes {low}, got {type(value).__name__} {value!r:.60}")


def min_rate_for_budget(bytes_: Union[Sequence[float], torch.Tensor, Mapping[str, float]],
                        budget_bytes: float, base_bytes: float = 0.0) -> float:
    """The smallest freeze rate such that ANY choice of trained layers fits the budget
    (worst case: the most expensive layers train). Raises ValueError if none does, and for
    arguments that are not byte counts (each named)."""
    _check_budget_args(budget_bytes, base_bytes)
    if isinstance(bytes_, Mapping):
        items = [(f"bytes_[{k!r}]", v) for k, v in bytes_.items()]
    elif isinstance(bytes_, torch.Tensor):
        items = [(f"bytes_[{i}]", v) for i, v in enumerate(bytes_.flatten().tolist())]
    elif isinstance(bytes_, Iterable) and not isinstance(bytes_, str):
        items = [(f"bytes_[{i}]", v) for i, v in enumerate(bytes_)]
    else:
        raise TypeError(f"min_rate_for_budget: bytes_ must be the per-layer activation bytes (a list, a tensor or "
                        f"a dict name -> bytes), got {type(bytes_).__name__}")
    if not items:
        raise ValueError("min_rate_for_budget: bytes_ is empty; pass the activation bytes of every scheduled layer")
    b = sorted((_byte_count(what, v) for what, v in items), reverse=True)
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
                         f"most expensive layer {b[0]:.4g} bytes): no freeze rate meets it whichever layers "
                         "train; raise the budget or lower base_bytes")
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

    if not isinstance(model, nn.Module):
        raise TypeError(f"estimate_activation_bytes: model must be an nn.Module, got {type(model).__name__}; "
                        "call it as estimate_activation_bytes(model, *inputs)")
    if isinstance(norm_fraction, bool) or not isinstance(norm_fraction, numbers.Real) \
            or not 0.0 <= norm_fraction <= 1.0:
        raise ValueError(f"estimate_activation_bytes: norm_fraction must be a number in [0, 1] (the share of a norm "
                         f"input freezing its weight saves: 0 for plain PyTorch, about 0.9 for slimfit's patched "
                         f"LayerNorm), got {type(norm_fraction).__name__} {norm_fraction!r}")
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
