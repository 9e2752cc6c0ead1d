"""ILSScheduler(update_scale="share"): each update of a trained layer is stretched by the
inverse of the share of steps that layer has trained so far (capped at layers / trained layers)."""
import pytest
import torch
from _models import MLP, regression_data

from slimfit.scheduler import ILSScheduler

LR = 1e-2


def _grads_after_backward(model, x, y):
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    return {id(p): p.grad.detach().clone() for p in model.parameters() if p.grad is not None}


@pytest.mark.parametrize("scale", ["share", "sqrt_share"])
@pytest.mark.parametrize("share", ["even", 0.0])
def test_each_update_is_stretched_by_steps_over_train_count(share, scale):
    torch.manual_seed(0)
    model = MLP()
    x, y = regression_data()
    opt = torch.optim.SGD(model.parameters(), lr=LR)      # update = -lr * grad: easy to replay
    sched = ILSScheduler(model, 0.6, optimizer=opt, min_train_share=share, update_scale=scale,
                         scheduled_kinds="all", warmup_steps=0)
    cap = 5 / 2                                           # 5 layers (norms included), 2 train each step
    seen_factors = set()
    for step in range(12):
        trained = [(n, p) for n, p in zip(sched.names, sched.params) if p.requires_grad]
        counts = sched.train_counts()
        before = {n: p.detach().clone() for n, p in trained}
        grads = _grads_after_backward(model, x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        for n, p in trained:
            factor = min(cap, (step + 1) / (counts[n] + 1)) ** (0.5 if scale == "sqrt_share" else 1.0)
            seen_factors.add(round(factor, 3))
            expected = before[n] - factor * LR * grads[id(p)]
            torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)
    top = round(cap ** (0.5 if scale == "sqrt_share" else 1.0), 3)
    assert len(seen_factors) > 2 and max(seen_factors) == top   # the rule was exercised, cap included


def test_scores_are_those_of_the_unscaled_update():
    torch.manual_seed(0)
    model = MLP()
    x, y = regression_data()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = ILSScheduler(model, 0.6, optimizer=opt, min_train_share="even", update_scale="share", warmup_steps=0)
    for _ in range(6):
        trained = [(n, p) for n, p in zip(sched.names, sched.params) if p.requires_grad]
        before = {n: p.detach().clone() for n, p in trained}
        grads = _grads_after_backward(model, x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        scores = sched.layer_scores()
        for n, p in trained:
            raw = (LR * grads[id(p)] / before[n]).abs().mean().item()   # SlimFit's relative score
            assert scores[n] == pytest.approx(raw, rel=1e-4)


def test_no_scaling_when_every_layer_trains_or_the_optimizer_skipped():
    torch.manual_seed(0)
    x, y = regression_data()
    runs = []
    for scale in ("none", "share"):
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        sched = ILSScheduler(model, 0.0, optimizer=opt, update_scale=scale, frozen_state=None)
        for _ in range(4):
            _grads_after_backward(model, x, y)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))   # rate 0: factor 1 everywhere, bit for bit

    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = ILSScheduler(model, 0.6, optimizer=opt, update_scale="share")
    for _ in range(3):
        _grads_after_backward(model, x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    frozen_now = [p.detach().clone() for p in model.parameters()]
    sched.step()                                          # no optimizer step since the last call
    assert sched.skipped_steps == 1
    assert all(torch.equal(a, p.detach()) for a, p in zip(frozen_now, model.parameters()))


def test_option_is_validated_and_saved():
    model = MLP()
    with pytest.raises(ValueError, match="update_scale must be one of"):
        ILSScheduler(model, 0.6, update_scale="yes")
    sched = ILSScheduler(model, 0.6, update_scale="share")
    assert sched.state_dict()["config"]["update_scale"] == "share"
