"""Per-family knowledge the generic patch cannot infer, one file per family (`<family>.py`, each
defining `FAMILY`), listed once in `_MODULES` below:

* which linear is the FFN output projection (its input is the activation output: ffn_out_input_bits) where
  structure cannot tell (structure.ffn_output_linears finds it inside one MLP module; BERT's is split
  over two sibling modules),
* which linears get WTA-CRS sampled weight gradients (the attention output projection and the FFN
  linears, never Q/K/V, as in the paper),
* which module classes slimfit recognises by name (SwiGLU MLPs, Llama-formula RMSNorms) or knows it
  must leave alone (with the reason the summary gives),
* notes (copied to `PatchSummary.notes`).

A family is found from `model.config.model_type`; unknown models get the generic patch. The class-name
knowledge is pooled over every registered family (`known_classes`): a LlamaMLP is recognised wherever
it sits, in a model of any family or of none. `register(family)` adds one at run time (tests, user code).
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

# PEFT LoRA wraps a target linear: <name>.base_layer (the original, frozen) and <name>.lora_A.<adapter>
# / <name>.lora_B.<adapter> (the adapters).
_LORA_SUFFIX = re.compile(r"\.(base_layer|lora_A\.[^.]+)$")
_LORA_B = re.compile(r"\.lora_B\.[^.]+$")


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple  # model.config.model_type values of this family (() for class knowledge only)
    ffn_out_suffixes: tuple = ()  # module-name suffixes of the FFN output projection
    sampled_suffixes: tuple = ()  # module-name suffixes of the linears sampled by SlimFitConfig.sampling
    # class names whose forward is exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)) (SwiGLUMixin)
    swiglu_mlps: tuple = ()
    # class names whose forward is exactly LlamaRMSNorm's: fp32 x * rsqrt(mean(x²) + eps), cast back, times
    # weight (RMSNormMixin)
    rmsnorms: tuple = ()
    not_compressed: tuple = ()  # (class name, reason) pairs: left alone, the reason in the summary
    notes: tuple = ()  # what a reader of the summary should know (PatchSummary.notes)

    def is_ffn_out(self, module_name: str) -> bool:
        return (any(module_name.endswith(suffix) for suffix in self.ffn_out_suffixes)
                and ".attention." not in module_name)

    def is_sample_target(self, module_name: str) -> bool:
        """A sampling target, or the base_layer / lora_A of a LoRA-wrapped target (not lora_B:
        its input has r values per token, nothing worth sampling)."""
        if _LORA_B.search(module_name):
            return False
        name = _LORA_SUFFIX.sub("", module_name)
        return any(name.endswith(suffix) for suffix in self.sampled_suffixes)


# The registry: one line per family file. Order matters only if two families claimed one model_type.
_MODULES = ("bert", "distilbert", "vit", "gpt2", "llama", "generic")
_registered: list = []


def all_families() -> tuple:
    """Every family: the built-in files, then those `register`ed."""
    builtin = tuple(importlib.import_module(f"{__name__}.{name}").FAMILY for name in _MODULES)
    return builtin + tuple(_registered)


def register(family: Family) -> Family:
    """Add a family (or class knowledge) at run time; returns it. `unregister` undoes it."""
    if not isinstance(family, Family):
        raise TypeError(f"slimfit.patching.families.register expects a Family, got {type(family).__name__}")
    _registered.append(family)
    return family


def unregister(family: Family) -> None:
    _registered.remove(family)


def family_for(model) -> Family | None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for family in all_families():
        if model_type in family.model_types:
            return family
    return None


def known_classes(field: str) -> frozenset:
    """The class names listed under `field` ('swiglu_mlps', 'rmsnorms') by any family."""
    return frozenset(name for family in all_families() for name in getattr(family, field))


def not_compressed() -> dict:
    """Class name -> why slimfit leaves it alone, from every family."""
    return {cls: reason for family in all_families() for cls, reason in family.not_compressed}
