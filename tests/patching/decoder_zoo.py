"""Tiny randomly initialised decoder LMs of many transformers families (no downloads), for the checks
every decoder must pass: causal masking, eval equality, truthful attention summary."""
from __future__ import annotations

import torch

VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, max_position_embeddings=64, head_dim=8, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)

# name -> (config class, model class, extra config fields)
DECODERS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(multi_query=True, new_decoder_architecture=False)),
    "falcon-alibi": ("FalconConfig", "FalconForCausalLM", dict(alibi=True, multi_query=False)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, n_inner=64)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=64, word_embed_proj_dim=32)),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", MOE),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", MOE),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(n_layer=2, n_head=4)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4)),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),
}


def build_decoder(name: str, implementation: str = "sdpa"):
    """(model, input_ids) for the decoder `name` of DECODERS, seeded, with the attention implementation
    `implementation` ("sdpa", transformers' default, or "eager")."""
    import transformers as tf

    config_name, model_name, extra = DECODERS[name]
    torch.manual_seed(0)
    fields = {**COMMON, **extra}
    if name.startswith("falcon"):
        del fields["head_dim"]  # derived from hidden_size / heads (a read-only property)
    config = getattr(tf, config_name)(**fields)
    model = getattr(tf, model_name)(config)
    if implementation != "sdpa":
        model.set_attn_implementation(implementation)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    return model, ids
