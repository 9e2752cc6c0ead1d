"""torch's functional Adam called as torch's own ``Adam.step`` calls it, on the tensors given.

The chunked step (chunked_step.py) and the held step (held_step.py) update views of a parameter, or its
moments decoded a piece at a time, with exactly the arithmetic of torch's step: the group's hyperparameters,
foreach or fused as the group says, and a GradScaler's scale and inf flag as the optimizer carries them.
"""
from __future__ import annotations

from torch.optim import adam as _adam

__all__ = ["adam_step", "lr_factors", "scaled_group"]


def adam_step(optimizer, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps) -> None:
    """One Adam/AdamW update of ``params`` in place (``steps`` counted up by one each), as ``optimizer``'s
    step would make it for ``group``; ``max_exp_avg_sqs`` is read only with amsgrad."""
    beta1, beta2 = group["betas"]
    amsgrad = group["amsgrad"]
    _adam.adam(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [], steps,
        foreach=group["foreach"], capturable=False, differentiable=False, fused=group["fused"],
        grad_scale=getattr(optimizer, "grad_scale", None), found_inf=getattr(optimizer, "found_inf", None),
        has_complex=False, decoupled_weight_decay=group.get("decoupled_weight_decay", False),
        amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
        eps=group["eps"], maximize=group["maximize"])


def lr_factors(observer, params) -> list:
    """Per parameter, the factor its update is stretched by this step (the scheduler's update_scale="share";
    1.0 without an observer that asks for one)."""
    ask = getattr(observer, "lr_factor", None)
    return [1.0 if ask is None else float(ask(p)) for p in params]


def scaled_group(group, factor: float) -> dict:
    """``group`` with its learning rate times ``factor`` (the group itself when the factor is 1)."""
    return group if factor == 1.0 else {**group, "lr": group["lr"] * factor}
