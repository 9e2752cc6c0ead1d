"""Tiny randomly initialised Hugging Face models built from configs (no downloads)."""
from __future__ import annotations

import torch

SEQ = 12
BATCH = 3
TEXT = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64)


def _text_inputs(vocab=97, pad_last=True):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if pad_last:
        mask[0, -4:] = 0  # padding in one sequence exercises the attention mask
    return {"input_ids": ids, "attention_mask": mask}


def build(family: str):
    """Returns (model, inputs, labels-aware loss function)."""
    import transformers as tf

    torch.manual_seed(0)
    if family in ("bert", "roberta", "electra"):
        cfg_cls, model_cls = {
            "bert": (tf.BertConfig, tf.BertForSequenceClassification),
            "roberta": (tf.RobertaConfig, tf.RobertaForSequenceClassification),
            "electra": (tf.ElectraConfig, tf.ElectraForSequenceClassification),
        }[family]
        extra = {"embedding_size": 32} if family == "electra" else {}
        model = model_cls(cfg_cls(**TEXT, num_labels=2, **extra))
        inputs = _text_inputs()
        inputs["labels"] = torch.tensor([0, 1, 1])
    elif family == "distilbert":
        cfg = tf.DistilBertConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                  max_position_embeddings=64, num_labels=2)
        model = tf.DistilBertForSequenceClassification(cfg)
        inputs = _text_inputs()
        inputs["labels"] = torch.tensor([0, 1, 1])
    elif family in ("vit", "deit", "dinov2"):
        common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4,
                      num_channels=3, num_labels=3)
        if family == "vit":
            model = tf.ViTForImageClassification(tf.ViTConfig(intermediate_size=64, **common))
        elif family == "deit":
            model = tf.DeiTForImageClassification(tf.DeiTConfig(intermediate_size=64, **common))
        else:
            model = tf.Dinov2ForImageClassification(tf.Dinov2Config(mlp_ratio=2, **common))
        g = torch.Generator().manual_seed(1)
        inputs = {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g), "labels": torch.tensor([0, 2, 1])}
    elif family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64, n_inner=64)
        model = tf.GPT2LMHeadModel(cfg)
        inputs = _text_inputs(pad_last=False)
        inputs["labels"] = inputs["input_ids"].clone()
    elif family in ("llama", "mistral", "qwen2"):
        cfg_cls, model_cls = {
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        }[family]
        cfg = cfg_cls(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
        model = model_cls(cfg)
        inputs = _text_inputs(pad_last=False)
        inputs["labels"] = inputs["input_ids"].clone()
    else:
        raise ValueError(family)
    return model, inputs


FAMILIES = ["bert", "roberta", "electra", "distilbert", "vit", "deit", "dinov2", "gpt2", "llama", "mistral", "qwen2"]
