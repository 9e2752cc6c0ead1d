"""LayerScale modules (DINOv2's lambda1) are recognised by structure, probe-verified, and keep their input
at 8 bits for the scale's gradient: outputs bit-identical, the scale's gradient within the format's error."""
import warnings

import torch

import slimfit
from slimfit import SlimFitConfig
from slimfit.memory import measure

from .encoder_zoo import build_model


def _grads(model, inputs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if "layer_scale" in n}


def test_dinov2_layer_scales_patched_with_gradient_error_of_the_format():
    model, inputs = build_model("dinov2")
    model.train()
    loss, plain = _grads(model, inputs)
    before = measure(model, **inputs).total
    errors = {}
    for bits in (4, 8):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            slimfit.patch(model, SlimFitConfig.exact().replace(ffn_out_input_bits=bits))
        kinds = [kind for _, kind, _ in model.slimfit_summary.patched]
        assert kinds.count("layer scale") == 4
        patched_loss, grads = _grads(model, inputs)
        assert torch.equal(patched_loss, loss)  # the forward is exact
        errors[bits] = max(float((grads[n] - g).norm() / g.norm()) for n, g in plain.items())
        if bits == 8:
            assert measure(model, **inputs).total < before
        slimfit.unpatch(model)
    # the scale's gradient sums g * x over 51 tokens of this tiny model; 8-bit codes of x are 17x finer than
    # 4-bit ones, and the error follows (measured: about 5% at 8 bits here, with cancellation in the sums)
    assert errors[8] < errors[4] / 4 and errors[8] < 0.1
