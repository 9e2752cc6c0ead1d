"""Attention with an additive position bias (T5's relative attention bias) goes through slimfit's core with
the bias folded into the mask as the model's own function folds it: the calls reach slimfit, the loss is the
model's own and every gradient, the bias's included, matches plain PyTorch (attention kept in full here, so
only the arithmetic order differs)."""
import warnings

import pytest
import torch

import slimfit
from slimfit import SlimFitConfig

from .encoder_zoo import build_model


def _without_dropout(model):
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "dropout", None), float):  # T5Attention's attention dropout
            module.dropout = 0.0
    return model


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_t5_position_bias_reaches_slimfit_with_matching_gradients(implementation):
    model, inputs = build_model("t5")
    model.set_attn_implementation(implementation)
    _without_dropout(model).train()
    loss = model(**inputs).loss
    loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        slimfit.patch(model, SlimFitConfig.exact().with_attention(qkv_bits=None))
    patched_loss = model(**inputs).loss
    patched_loss.backward()
    calls = model.slimfit_summary.attention_calls()
    assert calls["reached"] == calls["forwards"] == 6 and not calls["not_reached"]
    torch.testing.assert_close(patched_loss, loss, rtol=1e-6, atol=0)
    for name, grad in plain.items():
        err = float((model.get_parameter(name).grad - grad).norm() / grad.norm())
        assert err < 1e-5, name
