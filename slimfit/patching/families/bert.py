"""BERT layout: BERT, RoBERTa, ELECTRA (and CamemBERT/XLM-R, same modules)."""
from . import Family

# BertLayer: attention.output.dense (input: attention context) vs output.dense (input: GELU output).
FAMILY = Family(
    name="bert",
    model_types=("bert", "roberta", "electra", "camembert", "xlm-roberta"),
    ffn_out_suffixes=(".output.dense",),
    notes=("attention through the transformers attention registry",),
    # ".output.dense" also matches the attention output projection ".attention.output.dense"
    sampled_suffixes=(".output.dense", ".intermediate.dense"),
)
