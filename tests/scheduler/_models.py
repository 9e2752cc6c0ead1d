"""Tiny models shared by the scheduler tests (no downloads)."""
import torch
from torch import nn


class MLP(nn.Module):
    """2 hidden layers with LayerNorm: candidates fc1.weight, ln1.weight, fc2.weight,
    ln2.weight, head.weight (5 layers)."""

    def __init__(self, d_in=8, d=32):
        super().__init__()
        self.fc1, self.ln1 = nn.Linear(d_in, d), nn.LayerNorm(d)
        self.fc2, self.ln2 = nn.Linear(d, d), nn.LayerNorm(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        x = torch.relu(self.ln1(self.fc1(x)))
        x = torch.relu(self.ln2(self.fc2(x)))
        return self.head(x)


def regression_data(n=64, d_in=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    y = torch.sin(x[:, :1]) + 0.5 * x[:, 1:2]
    return x, y


def tiny_bert(num_labels=2, seed=0):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, num_labels=num_labels,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


def bert_batch(n=8, seq=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (n, seq), generator=g)
    labels = (ids[:, 0] % 2).long()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def tiny_llama(seed=0):
    """A 3-layer Llama with an untied head (every label of a batch counted: its mean loss over ranks' batches of
    one size is the union's mean)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)   # FSDP2 does not broadcast: the same init on every rank
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(config)
