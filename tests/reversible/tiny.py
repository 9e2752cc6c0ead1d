"""Tiny randomly initialised BERT / GPT-2 models and inputs for the MEFT tests (no downloads)."""
from __future__ import annotations

import torch

BATCH, SEQ, VOCAB = 3, 12, 97


def bert(layers: int = 4, dropout: float = 0.1, attn_dropout: float = 0.1, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=attn_dropout)
    return tf.BertForSequenceClassification(cfg)


def gpt2(layers: int = 4, dropout: float = 0.1, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=64, n_inner=64,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return tf.GPT2LMHeadModel(cfg)


def text_inputs(labels: bool = True, pad: bool = True) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if pad:
        mask[0, -4:] = 0
    out = {"input_ids": ids, "attention_mask": mask}
    if labels:
        out["labels"] = torch.tensor([0, 1, 1])
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()
