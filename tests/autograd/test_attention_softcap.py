"""slimfit.autograd.attention with soft-capped scores (Gemma2: cap·tanh(s / cap) before the mask): forward
equal to the formula, gradients exact with Q/K/V in full and bounded by the format at 8 bits."""
import pytest
import torch

from slimfit import autograd


def _reference(q, k, v, mask, scale, cap):
    s = q @ k.transpose(-1, -2) * scale
    s = torch.tanh(s / cap) * cap + mask
    return torch.softmax(s, -1) @ v


def _case():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 8, generator=gen).requires_grad_() for _ in range(3))
    mask = torch.zeros(1, 1, 9, 9)
    mask[..., 5:] = float("-inf")
    return q, k, v, mask, torch.randn(2, 3, 9, 8, generator=gen)


@pytest.mark.parametrize("probs", ["recompute", "full"])  # lossless modes of P
def test_softcap_matches_the_formula(probs):
    q, k, v, mask, g = _case()
    want = _reference(q, k, v, mask, 0.5, 2.0)
    want_grads = torch.autograd.grad(want, [q, k, v], g)
    got = autograd.attention(q, k, v, scale=0.5, attn_mask=mask, qkv_bits=None, probs=probs, softcap=2.0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(torch.autograd.grad(got, [q, k, v], g), want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_softcap_with_8_bit_qkv_is_bounded_by_the_format():
    q, k, v, mask, g = _case()
    want_grads = torch.autograd.grad(_reference(q, k, v, mask, 0.5, 2.0), [q, k, v], g)
    got = autograd.attention(q, k, v, scale=0.5, attn_mask=mask, qkv_bits=8, probs="recompute", softcap=2.0)
    for a, b in zip(torch.autograd.grad(got, [q, k, v], g), want_grads):
        assert float((a - b).norm() / b.norm()) < 0.03  # 8-bit Q/K/V: about 1% here


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "30"])
def test_softcap_must_be_a_positive_number(bad):
    q, k, v, _, _ = _case()
    with pytest.raises(ValueError, match="softcap"):
        autograd.attention(q, k, v, softcap=bad)
