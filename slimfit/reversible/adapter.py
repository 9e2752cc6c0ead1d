"""The bottleneck adapter MEFT inserts: down-projection, activation, dropout, up-projection.

    adapter(z) = W_up · dropout(act(W_down · z + b_down)) + b_up

Weights start from N(0, init_std²) (0.02 in the paper, = BERT's initializer_range), biases from
zero, so the adapter's output is small at init and the converted model starts near the
pretrained one. There is no residual inside: where the adapter sits decides what it adds to.
"""
from __future__ import annotations

import torch
from torch import nn


class Adapter(nn.Module):
    def __init__(self, hidden_size: int, bottleneck: int, activation: nn.Module | None = None,
                 dropout: float = 0.0, init_std: float = 0.02):
        super().__init__()
        self.down = nn.Linear(hidden_size, bottleneck)
        self.act = activation if activation is not None else nn.GELU()
        self.dropout = nn.Dropout(dropout)
        self.up = nn.Linear(bottleneck, hidden_size)
        with torch.no_grad():
            for lin in (self.down, self.up):
                nn.init.normal_(lin.weight, mean=0.0, std=init_std)
                nn.init.zeros_(lin.bias)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.up(self.dropout(self.act(self.down(z))))

    def extra_repr(self) -> str:
        return f"{self.down.in_features} -> {self.down.out_features} -> {self.up.out_features}"
