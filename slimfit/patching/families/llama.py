"""Llama family (Llama, Mistral, Qwen2): SwiGLU MLP (down_proj takes act(gate) * up), RMSNorm
and rotary embeddings.

* Linears and attention as everywhere else (grouped-query K/V are repeated before compression).
* The MLP (LlamaMLP / MistralMLP / Qwen2MLP) is patched as a whole when act_fn is SiLU: the product
  silu(gate) * up saves gate and up at `silu_bits` instead of three full tensors (gate for SiLU,
  silu(gate) and up for the product), see slimfit.autograd.silu.swiglu. Another act_fn leaves the
  MLP as is (reported in the summary).
* RMSNorm (LlamaRMSNorm / MistralRMSNorm / Qwen2RMSNorm) saves x̂ and rstd like LayerNorm, with the
  same config fields (layernorm, layernorm_frozen, experimental.topk_norms); the forward is the HF
  formula op for op (bit-identical). With both fields 'full' (exact()) RMSNorm is left alone.
* WTA-CRS targets: o_proj and the three MLP projections (never Q/K/V)."""
from . import Family

FAMILY = Family(
    name="llama",
    model_types=("llama", "mistral", "qwen2"),
    ffn_out_suffixes=(".mlp.down_proj",),
    notes=("SwiGLU product and RMSNorm compressed (silu_bits, layernorm fields)",
           "grouped-query K/V are repeated before compression"),
    sampled_suffixes=(".self_attn.o_proj", ".mlp.gate_proj", ".mlp.up_proj", ".mlp.down_proj"),
    # Checked against the installed transformers' modeling code; other variants (Gemma's (1 + w), fused
    # gate_up projections) are left alone and reported.
    swiglu_mlps=("LlamaMLP", "MistralMLP", "Qwen2MLP"),
    rmsnorms=("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"),
)
