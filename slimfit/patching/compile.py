"""`slimfit.compile(model)`: torch.compile for a model whose frozen set changes every step.

Dynamo guards every parameter's `requires_grad`; the scheduler flips them each step, so one graph
for the whole model recompiles whenever the frozen set changes and hits the recompile limit
within a few steps (docs/autograd.md, "torch.compile"). Compiled region by region instead, a
region's graph depends only on its own parameters' flags:

    granularity="module"  every patched layer (Linear, GELU, LayerNorm, Dropout, ...) compiled on its
                          own: at most 2 variants each (its weight trains or not). The default.
    granularity="block"   every entry of the model's nn.ModuleLists (the transformer blocks): more
                          fusion, but a block has up to 2**(candidates in it) variants.

Compiling is in place (`nn.Module.compile`): parameters, state_dict keys and hooks are unchanged,
and `slimfit.unpatch` still works.
"""
from __future__ import annotations

from torch import nn

from .modules import ORIGINAL_CLASS

GRANULARITIES = ("module", "block")


def compile_regions(model: nn.Module, *, granularity: str = "module", **compile_kwargs) -> nn.Module:
    """Compile `model`'s regions in place (see the module docstring); returns the model.
    compile_kwargs go to torch.compile (backend, mode, dynamic, ...)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"slimfit.compile expects a torch.nn.Module, got {type(model).__name__}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"slimfit.compile: granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "module":
        regions = [module for module in model.modules() if ORIGINAL_CLASS in vars(module)]
        if not regions:
            raise ValueError("slimfit.compile(granularity='module') compiles the patched layers, and this model "
                             "has none: call slimfit.patch(model, config) first (or use granularity='block')")
    else:
        regions = [block for blocks in model.modules() if isinstance(blocks, nn.ModuleList) for block in blocks]
        if not regions:
            raise ValueError("slimfit.compile(granularity='block') found no nn.ModuleList of blocks in this model; "
                             "use granularity='module'")
    # Static shapes unless asked: one graph serves every layer of a shape, and slimfit's linear
    # records stride facts on ctx that dynamo cannot trace with symbolic shapes (pad batches to a
    # fixed length, or a few lengths, when compiling).
    compile_kwargs.setdefault("dynamic", False)
    for region in regions:
        region.compile(**compile_kwargs)
    return model
