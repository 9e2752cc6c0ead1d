"""A LayerNorm with no weight or bias (OLMo's, computed in fp32 and cast back) is recognised by structure,
its hard-coded epsilon found by the patch-time probe: the forward stays bit-identical in fp32 and bf16, the
input gradient is the LayerNorm's at the compressed x̂, and it saves less than PyTorch; a parameter-free norm
of another formula is left alone with the reason."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimfit
from slimfit import SlimFitConfig
from slimfit.patching.modules import ORIGINAL_CLASS


class ToyOlmoNorm(nn.Module):   # OLMo's LayerNorm: no parameters, eps in the code
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.normalized_shape, self._eps = (d,), eps

    def forward(self, x):
        return F.layer_norm(x.to(torch.float32), self.normalized_shape, None, None, eps=self._eps).to(x.dtype)


class ToyMeanFreeNorm(ToyOlmoNorm):   # no mean subtracted: not a LayerNorm
    def forward(self, x):
        x32 = x.to(torch.float32)
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


class Block(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm, self.proj = norm, nn.Linear(32, 32)

    def forward(self, x):
        return self.proj(self.norm(x))


def _saved_bytes(fn, x):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(x)
    return out, sum(t.numel() * t.element_size() for t in saved)   # x too: saving it keeps it alive


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_with_its_epsilon_forward_identical_gradient_close(eps, dtype):
    torch.manual_seed(0)
    plain = Block(ToyOlmoNorm(32, eps)).to(dtype)
    model = Block(ToyOlmoNorm(32, eps)).to(dtype)
    model.load_state_dict(plain.state_dict())
    summary = slimfit.patch(model, SlimFitConfig.paper()).slimfit_summary
    assert ("norm", "layernorm", f"no weight (eps {eps:g}): x̂ int8") in summary.patched
    x = torch.randn(4, 6, 32, dtype=dtype) * 3 + 1
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    out_plain, bytes_plain = _saved_bytes(plain.norm, xs[0])
    out, bytes_patched = _saved_bytes(model.norm, xs[1])
    assert torch.equal(out, out_plain)
    assert bytes_patched < bytes_plain / 2
    grad = torch.randn(out.shape, dtype=dtype)
    out_plain.backward(grad)
    out.backward(grad)
    scale = xs[0].grad.abs().max().item()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=0, atol=0.05 * scale)


def test_a_parameter_free_norm_of_another_formula_is_left_alone_with_the_reason():
    model = Block(ToyMeanFreeNorm(32))
    summary = slimfit.patch(model, SlimFitConfig.paper()).slimfit_summary
    assert any(name == "norm" and "differs from the fp32 LayerNorm formula" in why
               for name, _, why in summary.skipped)
    assert type(model.norm) is ToyMeanFreeNorm and not hasattr(model.norm, ORIGINAL_CLASS)
