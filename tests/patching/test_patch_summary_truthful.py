"""The summary reports only what happened: a model with nothing slimfit patches is said to be plain
PyTorch (and patch warns), and the model-wide SDPA router counts the calls it actually took."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimfit
from slimfit.patching.summary import NOTHING_PATCHED


@pytest.mark.parametrize("make", [lambda: nn.Sequential(nn.Sigmoid(), nn.Tanh()),
                                  lambda: nn.Sequential(nn.Embedding(10, 4), nn.Tanh())],
                         ids=["activations", "embedding"])
def test_nothing_patched_is_said(make):
    with pytest.warns(UserWarning, match="nothing is compressed"):
        model = slimfit.patch(make(), slimfit.SlimFitConfig.paper())
    text = str(model.slimfit_summary)
    assert NOTHING_PATCHED in text
    assert not [line for line in text.splitlines() if line.startswith("  patched")]
    assert not model.slimfit_summary.compresses_anything()


class _SelfAttention(nn.Module):
    def forward(self, x):
        return F.scaled_dot_product_attention(x, x, x, is_causal=True)


def test_sdpa_router_counts_the_calls_it_took():
    with pytest.warns(UserWarning, match="nothing is compressed"):
        model = slimfit.patch(nn.Sequential(_SelfAttention()), slimfit.SlimFitConfig.paper())
    summary = model.slimfit_summary
    assert "0 took slimfit's core" in str(summary)
    x = torch.randn(1, 2, 5, 8, requires_grad=True)
    model(x).sum().backward()
    assert "1 took slimfit's core" in str(summary)
    assert summary.compresses_anything() and NOTHING_PATCHED not in str(summary)
