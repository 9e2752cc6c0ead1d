"""A tiny real decoder held in bf16 (or fp16), as an LLM is loaded with ``torch_dtype=torch.bfloat16``: the
shared model and batch of tests/bf16, and the bf16 rounding constants their tolerances are derived from."""
from __future__ import annotations

import copy

import torch

# bf16 keeps 8 significant bits (7 stored): one rounding to nearest moves a value by at most half an ulp,
# a relative 2**-8 (the unit roundoff u); fp16 keeps 11 (u = 2**-11).
BF16_U = 2.0 ** -8
VOCAB, SEQ, BATCH = 1000, 17, 2


def build_decoder(dtype: torch.dtype = torch.bfloat16, seed: int = 0, layers: int = 2):
    """A randomly initialised LlamaForCausalLM (no download): hidden 64, 4 query / 2 key-value heads
    (grouped-query attention), SwiGLU MLP of 128, RMSNorm, untied head, vocabulary 1000, SDPA attention,
    with every parameter and buffer cast to ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="sdpa", tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(dtype).train()


def batch(seed: int = 1) -> torch.Tensor:
    """Token ids (BATCH, SEQ): the inputs and, shifted inside the model, the labels."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def clone(model):
    return copy.deepcopy(model)
