"""DistilBERT: TransformerBlock.ffn = lin1 -> GELU -> lin2."""
from . import Family

FAMILY = Family(
    name="distilbert",
    model_types=("distilbert",),
    ffn_out_suffixes=(".ffn.lin2",),
    notes=("attention through the transformers attention registry",),
    sampled_suffixes=(".attention.out_lin", ".ffn.lin1", ".ffn.lin2"),
)
