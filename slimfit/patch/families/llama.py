"""Llama family (Llama, Mistral, Qwen2): SwiGLU MLP (down_proj takes act(gate) * up), RMSNorm
and rotary embeddings. Linear and attention paths are patched; SiLU and RMSNorm are left
alone (no compressed implementation yet: they are reported in the summary)."""
from . import Family

FAMILY = Family(
    name="llama",
    model_types=("llama", "mistral", "qwen2"),
    ffn_out_suffixes=(".mlp.down_proj",),
    notes=("SiLU and RMSNorm left alone", "grouped-query K/V are repeated before compression"),
)
