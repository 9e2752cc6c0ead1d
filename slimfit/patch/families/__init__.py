"""Per-family knowledge the generic patch cannot infer: which linear layer is the FFN
output projection (its input is the activation output), which linears get WTA-CRS sampled
weight gradients (the attention output projection and the FFN linears, never Q/K/V, as in the
paper), and notes for the summary.

A family is found from `model.config.model_type`; unknown models get the generic patch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

# PEFT LoRA wraps a target linear: <name>.base_layer (the original, frozen) and <name>.lora_A.<adapter>
# / <name>.lora_B.<adapter> (the adapters).
_LORA_SUFFIX = re.compile(r"\.(base_layer|lora_A\.[^.]+)$")
_LORA_B = re.compile(r"\.lora_B\.[^.]+$")


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple
    ffn_out_suffixes: tuple  # module-name suffixes of the FFN output projection
    notes: tuple = field(default_factory=tuple)
    sampled_suffixes: tuple = ()  # module-name suffixes of the linears sampled by linear_sampling

    def is_ffn_out(self, module_name: str) -> bool:
        return any(module_name.endswith(s) for s in self.ffn_out_suffixes) and ".attention." not in module_name

    def is_sample_target(self, module_name: str) -> bool:
        """A sampling target, or the base_layer / lora_A of a LoRA-wrapped target (not lora_B:
        its input has r values per token, nothing worth sampling)."""
        if _LORA_B.search(module_name):
            return False
        name = _LORA_SUFFIX.sub("", module_name)
        return any(name.endswith(s) for s in self.sampled_suffixes)


def _all():
    from . import bert, distilbert, gpt2, llama, vit

    return [bert.FAMILY, distilbert.FAMILY, vit.FAMILY, gpt2.FAMILY, llama.FAMILY]


def family_for(model) -> Family | None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for fam in _all():
        if model_type in fam.model_types:
            return fam
    return None
