"""Tiny randomly initialised encoders, vision models and encoder-decoders of many transformers families
(no downloads), for the checks every architecture must pass: eval equality, exact() gradients, truthful
attention summary."""
from __future__ import annotations

import torch

VOCAB = 97
TEXT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, num_labels=3, pad_token_id=0)
IMAGE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
             patch_size=4, num_channels=3, num_labels=3)

# name -> (config class, model class, extra config fields, input kind)
MODELS = {
    "bert": ("BertConfig", "BertForSequenceClassification", {}, "text"),
    "roberta": ("RobertaConfig", "RobertaForSequenceClassification", {}, "text"),
    "electra": ("ElectraConfig", "ElectraForSequenceClassification", {"embedding_size": 32}, "text"),
    "albert": ("AlbertConfig", "AlbertForSequenceClassification", {"embedding_size": 16}, "text"),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaForSequenceClassification", {}, "text"),
    "deberta-v2": ("DebertaV2Config", "DebertaV2ForSequenceClassification", {}, "text"),
    "modernbert": ("ModernBertConfig", "ModernBertForSequenceClassification",
                   {"global_attn_every_n_layers": 2, "local_attention": 8}, "text"),
    "mpnet": ("MPNetConfig", "MPNetForSequenceClassification", {}, "text"),
    "vit": ("ViTConfig", "ViTForImageClassification", {}, "image"),
    "deit": ("DeiTConfig", "DeiTForImageClassification", {}, "image"),
    "dinov2": ("Dinov2Config", "Dinov2ForImageClassification", {"mlp_ratio": 2}, "image"),
    "beit": ("BeitConfig", "BeitForImageClassification", {}, "image"),
    "t5": ("T5Config", "T5ForConditionalGeneration",
           {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "decoder_start_token_id": 0},
           "seq2seq"),
    "bart": ("BartConfig", "BartForConditionalGeneration",
             {"d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
              "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64}, "seq2seq"),
}


def build_model(name: str):
    """(model, inputs with labels) for the model `name` of MODELS, seeded."""
    import transformers as tf

    config_name, model_name, extra, kind = MODELS[name]
    torch.manual_seed(0)
    base = IMAGE if kind == "image" else TEXT
    model = getattr(tf, model_name)(getattr(tf, config_name)(**{**base, **extra}))
    generator = torch.Generator().manual_seed(1)
    if kind == "image":
        return model, {"pixel_values": torch.randn(3, 3, 16, 16, generator=generator),
                       "labels": torch.tensor([0, 2, 1])}
    ids = torch.randint(3, VOCAB, (3, 12), generator=generator)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, -4:] = 0
    if kind == "seq2seq":
        return model, {"input_ids": ids, "attention_mask": mask, "labels": ids[:, :7].clone()}
    return model, {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2, 1])}
