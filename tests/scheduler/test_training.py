"""Training with AdamW (weight decay > 0): frozen layers stand still, the rest learn."""
import io

import pytest
import torch
from _models import MLP, bert_batch, regression_data, tiny_bert
from torch import nn

from slimfit.scheduler import ILSScheduler, estimate_activation_bytes, min_rate_for_budget


def _mlp_setup(rate=0.6, seed=0, **kw):
    torch.manual_seed(seed)
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    s = ILSScheduler(m, freeze_rate=rate, optimizer=opt, warmup_steps=0, **kw)
    return m, opt, s


def _mlp_loss(m, step):
    x, y = regression_data(seed=step % 3)
    return nn.functional.mse_loss(m(x), y)


def _train_and_check(model, opt, sched, loss_fn, steps, zero_mode):
    cand = dict(zip(sched.names, sched.params))
    losses = []
    for step in range(steps):
        frozen = set(sched.frozen_names())
        assert frozen and len(frozen) < len(cand)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        loss = loss_fn(model, step)
        loss.backward()
        for n in frozen:
            assert cand[n].grad is None, n          # frozen: no grad, no weight-gradient work
        if zero_mode == "zeros_everywhere":         # a caller that hands out zero grads
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=(zero_mode == "none"))
        for n, p in model.named_parameters():
            if n in frozen:
                assert torch.equal(before[n], p), f"frozen {n} moved at step {step}"
            elif n in cand or n.endswith("bias"):
                assert not torch.equal(before[n], p), f"trained {n} did not move at step {step}"
        losses.append(loss.item())
        sched.step()
    return losses


@pytest.mark.parametrize("zero_mode", ["none", "zeros", "zeros_everywhere"])
def test_mlp_frozen_bit_identical_and_loss_falls(zero_mode):
    m, opt, s = _mlp_setup(rate=0.6)
    losses = _train_and_check(m, opt, s, _mlp_loss, 16, zero_mode)
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3])
    if zero_mode == "zeros_everywhere":
        assert s._guard.dropped > 0                  # the pre-hook did the work


def test_zero_grads_would_leak_without_the_guard():
    """Documents why the optimizer hook exists: zero grad + AdamW moves a frozen weight."""
    torch.manual_seed(0)
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    s = ILSScheduler(m, freeze_rate=0.6, warmup_steps=0)   # no optimizer attached
    name = s.frozen_names()[0]
    p = dict(m.named_parameters())[name]
    p.grad = torch.zeros_like(p)
    before = p.detach().clone()
    opt.step()
    assert not torch.equal(before, p)                # weight decay leaked
    s.attach_optimizer(opt)
    p.grad = torch.zeros_like(p)
    before = p.detach().clone()
    opt.step()
    assert torch.equal(before, p) and p.grad is None


def test_tiny_bert_trains_with_frozen_layers():
    m = tiny_bert()
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.01)
    s = ILSScheduler(m, freeze_rate=0.8, optimizer=opt, warmup_steps=0)
    assert s.num_layers == 13 and s.num_frozen == 10   # 22 candidates; embeddings, norms and the head train every step
    batch = bert_batch()
    losses = _train_and_check(m, opt, s, lambda mm, i: mm(**batch).loss, 12, "zeros")
    assert min(losses[-3:]) < losses[0]
    assert int(s._seen.sum()) == 13                   # round robin reached every layer


def test_optimizer_state_survives_freeze_and_unfreeze():
    # the optimizer's own state, as it made it (the state held 8-bit while frozen: tests/optim)
    m, opt, s = _mlp_setup(rate=0.6, frozen_state=None)
    cand = dict(zip(s.names, s.params))
    cycles = {n: [] for n in s.names}                # per step: trained?
    for step in range(12):
        frozen = set(s.frozen_names())
        st_before = {n: {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
                     for n, p in cand.items() if p in opt.state}
        _mlp_loss(m, step).backward()
        opt.step()
        opt.zero_grad()
        for n, p in cand.items():
            cycles[n].append(n not in frozen)
            if n in frozen and n in st_before:       # frozen: state untouched, bit for bit
                for k, v in st_before[n].items():
                    assert torch.equal(torch.as_tensor(v), torch.as_tensor(opt.state[p][k])), (n, k)
        s.step()
    resumed = [n for n, t in cycles.items() if any(not a and b for a, b in zip(t, t[1:]))]
    assert len(resumed) >= 2, cycles
    for n, p in cand.items():
        # AdamW's per-parameter step counts only the steps the layer trained: nothing was
        # reset by freezing, and a resumed layer continues from its old moments
        assert float(opt.state[p]["step"]) == sum(cycles[n])


def _run(m, opt, s, start, stop, log):
    for step in range(start, stop):
        log.append(tuple(s.frozen_names()))
        _mlp_loss(m, step).backward()
        opt.step()
        opt.zero_grad()
        s.step()


@pytest.mark.parametrize("score", ["relative", "robust", "absolute"])
def test_resume_makes_identical_decisions(score):
    kw = dict(score=score, min_trained_steps=1, min_frozen_steps=2)
    m, opt, s = _mlp_setup(rate=0.6, **kw)
    full = []
    _run(m, opt, s, 0, 10, full)
    ref = {n: p.detach().clone() for n, p in m.named_parameters()}

    m, opt, s = _mlp_setup(rate=0.6, **kw)
    part = []
    _run(m, opt, s, 0, 5, part)
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "sched": s.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    # a fresh process: new objects (another init seed for torch), state loaded
    m2, opt2, s2 = _mlp_setup(rate=0.6, seed=123, **kw)
    m2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    s2.load_state_dict(ck["sched"])
    assert tuple(s2.frozen_names()) == tuple(s.frozen_names())
    assert [p.requires_grad for p in s2.params] == [p.requires_grad for p in s.params]
    _run(m2, opt2, s2, 5, 10, part)
    assert part == full
    for n, p in m2.named_parameters():
        assert torch.equal(p, ref[n]), n


def test_resume_mid_step_with_snapshots():
    """Checkpoint written between optimizer.step() and scheduler.step(): snapshots needed."""
    m, opt, s = _mlp_setup(rate=0.6)
    full = []
    _run(m, opt, s, 0, 6, full)

    m, opt, s = _mlp_setup(rate=0.6)
    part = []
    _run(m, opt, s, 0, 3, part)
    part.append(tuple(s.frozen_names()))
    _mlp_loss(m, 3).backward()
    opt.step()
    opt.zero_grad()
    ck = {"model": m.state_dict(), "opt": opt.state_dict(), "sched": s.state_dict(include_snapshots=True)}
    m2, opt2, s2 = _mlp_setup(rate=0.6, seed=5)
    m2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    s2.load_state_dict(ck["sched"])
    opt2.step()                                     # the attached optimizer "stepped" (no grads: no-op)
    s2.step()
    _run(m2, opt2, s2, 4, 6, part)
    assert part == full


def test_step_without_optimizer_step_is_skipped():
    m, opt, s = _mlp_setup(rate=0.6)
    first = s.frozen_names()
    s.step()                                         # no optimizer step yet
    assert s.frozen_names() == first and s.skipped_steps == 1 and s.step_count == 0
    _mlp_loss(m, 0).backward()
    opt.step()
    s.step()
    s.step()                                         # a second call for the same optimizer step
    assert s.step_count == 1 and s.skipped_steps == 2


def test_memory_aware_and_budget():
    x, _ = regression_data()
    m = MLP()
    est = estimate_activation_bytes(m, x)
    assert est == {"fc1.weight": 64 * 8 * 4, "ln1.weight": 0, "fc2.weight": 64 * 32 * 4,
                   "ln2.weight": 0, "head.weight": 64 * 32 * 4}
    est_ln = estimate_activation_bytes(m, x, norm_fraction=0.5)
    assert est_ln["ln1.weight"] == 64 * 32 * 2

    # budget: fc2 and head cost 8 KiB each, fc1 2 KiB; 12 KiB of room -> never fc2 and head together
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    s = ILSScheduler(m, freeze_rate=0.0, activation_bytes=est, budget_bytes=13000, base_bytes=1000,
                     optimizer=opt)
    for step in range(8):
        assert s.trained_bytes() <= 12000
        assert s.effective_rate >= 0.0
        _mlp_loss(m, step).backward()
        opt.step()
        opt.zero_grad()
        s.step()
    assert int(s._seen.sum()) == 3                    # every scheduled layer (fc1, fc2, head) trained at some point
    assert "budget" in s.summary()

    with pytest.raises(ValueError, match="cannot be met"):
        ILSScheduler(MLP(), activation_bytes={"fc1.weight": 10, "ln1.weight": 10, "fc2.weight": 10,
                                              "ln2.weight": 10, "head.weight": 10}, budget_bytes=100,
                     base_bytes=95)
    with pytest.raises(ValueError, match="need activation_bytes"):
        ILSScheduler(MLP(), budget_bytes=100)
    with pytest.raises(ValueError, match="not candidate layers"):
        ILSScheduler(MLP(), activation_bytes={"fc1.bias": 1}, memory_aware=True)

    # Norm weights train every step by default: the bytes given for them join the base.
    s = ILSScheduler(MLP(), 0.0, activation_bytes=est_ln, budget_bytes=10**6, base_bytes=7)
    assert s.base_bytes == 7 + est_ln["ln1.weight"] + est_ln["ln2.weight"] and s.num_layers == 3

    # memory-aware, every kind scheduled: zero-byte layers (norm weights) are the cheapest to train,
    # so they stay trained
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    s = ILSScheduler(m, freeze_rate=0.6, memory_aware=True, activation_bytes=est, optimizer=opt,
                     scheduled_kinds="all", warmup_steps=0)
    for step in range(6):
        _mlp_loss(m, step).backward()
        opt.step()
        opt.zero_grad()
        s.step()
    assert sorted(s.trained_names()) == ["ln1.weight", "ln2.weight"]

    assert min_rate_for_budget([8, 8, 2, 0, 0], budget_bytes=12) == pytest.approx(0.8)  # any 1 fits
    assert min_rate_for_budget([8, 2, 2, 0, 0], budget_bytes=12) == 0.0                  # all fit
    assert min_rate_for_budget([8, 2, 2, 0, 0], budget_bytes=11) == pytest.approx(0.6)  # 8+2 fit, 8+2+2 not
    with pytest.raises(ValueError):
        min_rate_for_budget([8, 8], budget_bytes=10, base_bytes=5)


def test_close_unfreezes_everything():
    m, opt, s = _mlp_setup(rate=0.6)
    s.close()
    assert all(p.requires_grad for p in m.parameters())
    with pytest.raises(RuntimeError, match="closed"):
        s.step()
