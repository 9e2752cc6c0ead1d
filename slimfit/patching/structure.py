"""Recognising layers by what they compute, not by their class name.

A handler takes a module when its structure fits (the predicates below: a norm with a 1-D weight and an
epsilon, a gated MLP with gate/up/down projections or a fused gate_up projection and a SiLU activation)
and, at patch time, slimfit's forward gives bit-identical output to the module's own forward on a small
seeded probe input (`agrees`). A module that fits but disagrees is left alone, and the summary says so.
Model code changes every release; a list of class names is always behind, a probe is not.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

PROBE_ROWS = (2, 3)  # the probe input's leading shape: small, and more than one row
_EPS_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon")
_ACTIVATION_ATTRIBUTES = ("act_fn", "activation_fn", "act")


def probe_input(features: int, like: torch.Tensor) -> torch.Tensor:
    """A seeded random (2, 3, features) input in `like`'s dtype and device (the module's weights)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(*PROBE_ROWS, features, generator=generator).to(dtype=like.dtype, device=like.device)


def agrees(module: nn.Module, original_class: type, x: torch.Tensor, *rest) -> bool:
    """Whether the patched `module` (its class already swapped) computes, with a graph, output
    bit-identical to its original class's forward on `x` (and further arguments `rest`): same dtype,
    same values."""
    return probe_verdict(module, original_class, x, *rest) is None


def probe_verdict(module: nn.Module, original_class: type, x: torch.Tensor, *rest) -> str | None:
    """None when the patched `module` agrees with its original class's forward on the probe (see `agrees`),
    else what happened, for the summary: the largest difference, another dtype, or the error the probe raised.
    Running out of memory is raised, not reported as a disagreement."""
    try:
        with torch.no_grad():
            expected = original_class.forward(module, x, *rest)
        with torch.enable_grad():
            got = module(x.detach().requires_grad_(True), *rest)
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - a forward that cannot run on the probe is not taken
        return f"the probe raised {type(exc).__name__}: {str(exc)[:120]}"
    if not (isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor)):
        return "the probe's outputs are not tensors"
    if got.dtype != expected.dtype:
        return f"the replacement gives {got.dtype}, the module {expected.dtype}"
    if not torch.equal(got.detach(), expected):
        if got.shape != expected.shape:
            return f"the replacement gives shape {tuple(got.shape)}, the module {tuple(expected.shape)}"
        diff = (got.detach().double() - expected.double()).abs().max().item()
        return f"its output differs on a probe input (max |difference| {diff:.3g})"
    return None


@contextlib.contextmanager
def random_weight(weight: torch.Tensor):
    """The weight holds seeded random values in [0.5, 1.5) while the block runs, its own values after."""
    kept = weight.detach().clone()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        weight.copy_((torch.rand(weight.shape, generator=generator) + 0.5).to(weight.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            weight.copy_(kept)


def norm_epsilon(module: nn.Module) -> str | None:
    """The attribute holding a norm's epsilon, if the module has one (a float)."""
    for name in _EPS_ATTRIBUTES:
        if isinstance(getattr(module, name, None), float):
            return name
    return None


def is_rmsnorm_shaped(module: nn.Module) -> bool:
    """A norm over the last dimension with one 1-D weight, no bias and an epsilon (RMSNorm's parameters);
    whether it computes RMSNorm, and with which weight offset, the probe decides."""
    weight = getattr(module, "weight", None)
    params = dict(module.named_parameters(recurse=False))
    return (isinstance(weight, nn.Parameter) and weight.dim() == 1 and weight.is_floating_point()
            and set(params) == {"weight"} and not any(True for _ in module.children())
            and norm_epsilon(module) is not None and "norm" in type(module).__name__.lower())


def activation_attribute(module: nn.Module, classes: tuple) -> str | None:
    """The name of the module's activation child when it is one of `classes`."""
    for name in _ACTIVATION_ATTRIBUTES:
        if isinstance(getattr(module, name, None), classes):
            return name
    return None


def _linear(module, name: str) -> bool:
    return isinstance(getattr(module, name, None), nn.Linear)


def ffn_output_linears(model: nn.Module, activations: tuple) -> frozenset:
    """ids of the linears that are an MLP's output projection by structure, whose input is the activation
    (or gated product) output that `ffn_out_input_bits` is for:
      a gated MLP's down projection (`gated_mlp_layout`: separate or fused gate/up);
      beside an activation child (one of `activations`, an act_fn / activation_fn / act attribute, or another
      parameter-free child that is not a dropout: BLOOM's gelu_impl) and one expanding linear H -> I (I > H,
      H the model's hidden size where its config says it), the linear I -> H: in the same module (GPT-NeoX,
      Phi, Falcon, GPT-J, StarCoder2, BLOOM, OPT's decoder layer, whose attention linears are H -> H) or, when
      the MLP is split over two sibling modules, the one sibling's linear child I -> H (BERT, DeBERTa, ViT:
      intermediate.dense, output.dense). A bottleneck adapter's H -> r -> H is no MLP (r < H)."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    found = set()
    split = {}   # id of a module holding an activation and an expanding linear but not its partner -> that linear
    for module in model.modules():
        layout = gated_mlp_layout(module)
        if layout is not None:
            found.add(id(module.down_proj if layout == "separate" else getattr(module, fused_gated_names(module)[1])))
            continue
        expanding = _expanding(module, activations, hidden)
        if expanding is None:
            continue
        inside = _contracting(module.children(), expanding)
        if len(inside) == 1:
            found.add(id(inside[0]))
        elif not inside:
            split[id(module)] = expanding
    for parent in model.modules():  # an MLP split over sibling modules
        children = list(parent.children())
        for child in children:
            expanding = split.get(id(child))
            if expanding is None:
                continue
            beside = _contracting((grandchild for sibling in children if sibling is not child
                                   for grandchild in sibling.children()), expanding)
            if len(beside) == 1:
                found.add(id(beside[0]))
    return frozenset(found)


def _expanding(module: nn.Module, activations: tuple, hidden: int | None) -> nn.Linear | None:
    """The one linear child H -> I (I > H; H == hidden when known) of a module with an activation child."""
    children = list(module.children())
    if not any(_is_activation(child, activations) for child in children) and \
            activation_attribute(module, (nn.Module,)) is None:
        return None
    expanding = [child for child in children if isinstance(child, nn.Linear) and child.out_features > child.in_features
                 and (hidden is None or child.in_features == hidden)]
    return expanding[0] if len(expanding) == 1 else None


def _contracting(candidates, expanding: nn.Linear) -> list:
    """The linears among `candidates` that map the expanding linear's I back to its H."""
    return [c for c in candidates if isinstance(c, nn.Linear)
            and (c.in_features, c.out_features) == (expanding.out_features, expanding.in_features)]


def _is_activation(child: nn.Module, activations: tuple) -> bool:
    if isinstance(child, activations):
        return True
    return (not isinstance(child, nn.Dropout) and next(child.parameters(), None) is None
            and next(child.buffers(), None) is None and next(child.children(), None) is None)


def gated_mlp_layout(module: nn.Module) -> str | None:
    """'separate' (gate_proj, up_proj, down_proj), 'fused' (one linear producing [gate, up], then the down
    projection: fused_gated_names), or None."""
    if _linear(module, "down_proj") and _linear(module, "gate_proj") and _linear(module, "up_proj"):
        return "separate"
    return "fused" if fused_gated_names(module) is not None else None


def fused_gated_names(module: nn.Module) -> tuple[str, str, str | None] | None:
    """(the fused gate-up linear, the down linear, a dropout between them or None) of a gated MLP whose gate
    and up projections are one linear producing [gate, up] along the last dimension: Phi-3's gate_up_proj
    and down_proj by name, or by structure (ModernBERT's Wi, drop, Wo): exactly two linear children, the
    first H -> 2I, the second I -> H, and at most one dropout child. The patch-time probe checks the rest
    (that the forward is down(dropout(act(gate) * up)))."""
    if _linear(module, "gate_up_proj") and _linear(module, "down_proj"):
        return ("gate_up_proj", "down_proj", None) if module.gate_up_proj.out_features % 2 == 0 else None
    children = list(module.named_children())
    linears = [(name, child) for name, child in children if isinstance(child, nn.Linear)]
    dropouts = [name for name, child in children if isinstance(child, nn.Dropout)]
    if len(linears) != 2 or len(dropouts) > 1:
        return None
    (first_name, first), (second_name, second) = linears
    if first.out_features != 2 * second.in_features or second.out_features != first.in_features:
        return None
    return first_name, second_name, dropouts[0] if dropouts else None
