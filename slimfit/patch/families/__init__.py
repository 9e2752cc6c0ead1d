"""Per-family knowledge the generic patch cannot infer: which linear layer is the FFN
output projection (its input is the activation output), and notes for the summary.

A family is found from `model.config.model_type`; unknown models get the generic patch.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple
    ffn_out_suffixes: tuple  # module-name suffixes of the FFN output projection
    notes: tuple = field(default_factory=tuple)

    def is_ffn_out(self, module_name: str) -> bool:
        return any(module_name.endswith(s) for s in self.ffn_out_suffixes) and ".attention." not in module_name


def _all():
    from . import bert, distilbert, gpt2, llama, vit

    return [bert.FAMILY, distilbert.FAMILY, vit.FAMILY, gpt2.FAMILY, llama.FAMILY]


def family_for(model) -> Family | None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for fam in _all():
        if model_type in fam.model_types:
            return fam
    return None
