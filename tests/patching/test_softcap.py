"""Gemma2's soft-capped attention reaches slimfit's materializing core: every call counted as reached, the
loss the model's own and every gradient as plain PyTorch's (attention kept in full here)."""
import warnings

import torch

import slimfit
from slimfit import SlimFitConfig

from .decoder_zoo import build_decoder


def test_gemma2_softcapped_attention_reaches_slimfit_with_matching_gradients():
    model, ids = build_decoder("gemma2")
    model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        slimfit.patch(model, SlimFitConfig.exact().with_attention(qkv_bits=None))
    patched = model(ids, labels=ids).loss
    patched.backward()
    calls = model.slimfit_summary.attention_calls()
    assert calls["reached"] == calls["forwards"] == 2 and not calls["not_reached"]
    torch.testing.assert_close(patched, loss, rtol=1e-6, atol=0)
    for name, grad in plain.items():
        assert float((model.get_parameter(name).grad - grad).norm() / grad.norm()) < 1e-5, name
