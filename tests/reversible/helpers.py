"""Shared measurements for the MEFT tests: reconstruction error per layer, gradient agreement."""
from __future__ import annotations

import torch

import slimfit.reversible as rv

from .tiny import rel


def reconstruction_errors(model, inputs, seed: int = 5) -> list[float]:
    """Per reversible layer (bottom first): max over (x1, x2) of ‖x_backward − x_forward‖ / ‖x_forward‖."""
    with rv.record_states(model) as rec:
        torch.manual_seed(seed)
        model(**inputs).loss.backward()
    model.zero_grad(set_to_none=True)
    return [max(rel(b, f) for b, f in zip(rec.backward[i], rec.forward[i])) for i in sorted(rec.backward)]


def trainable_grads(model, inputs, seed: int = 5) -> tuple[float, dict]:
    torch.manual_seed(seed)
    loss = model(**inputs).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def grad_agreement(model, inputs, seed: int = 5) -> tuple[float, float, float]:
    """(loss reversible, loss plain, max over trainable parameters of ‖g_rev − g_plain‖ / ‖g_plain‖):
    the same converted network, reversible backward vs plain autograd, same seed."""
    n = rv.summary(model).reversible_layers
    loss_r, g_r = trainable_grads(model, inputs, seed)
    rv.set_reversible_layers(model, 0)
    try:
        loss_p, g_p = trainable_grads(model, inputs, seed)
    finally:
        rv.set_reversible_layers(model, n)
    assert g_r.keys() == g_p.keys()
    # a gradient that is zero in exact arithmetic (the key bias: softmax ignores a per-query shift)
    # is rounding noise in both runs; measure every difference against at least 1e-4 of the largest
    floor = 1e-4 * max(g.double().norm().item() for g in g_p.values())
    return loss_r, loss_p, max(((g_r[k] - g_p[k]).double().norm() / max(g_p[k].double().norm().item(), floor)).item()
                               for k in g_p)
