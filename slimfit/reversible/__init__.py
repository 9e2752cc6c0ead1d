"""MEFT (arXiv 2306.00477): reversible adapters that keep the pretrained starting point.

    model, summary = slimfit.reversible.convert(model, form="meft1", bottleneck=8)
    loss = model(input_ids=..., attention_mask=..., labels=...).loss   # the unconverted model's call
    loss.backward()    # reversible layers: only the last output pair is kept; inputs reconstructed

See docs/meft.md for the exact formulas, the distance to the pretrained model at init and the
measured reconstruction error.
"""
from .adapter import Adapter
from .convert import (
    FORMS,
    MeftSummary,
    add_adapters,
    convert,
    record_states,
    set_reversible_layers,
    summary,
    unconvert,
)
from .layouts import SUPPORTED, UnsupportedModel

__all__ = ["Adapter", "FORMS", "MeftSummary", "SUPPORTED", "UnsupportedModel", "add_adapters", "convert",
           "record_states", "set_reversible_layers", "summary", "unconvert"]
