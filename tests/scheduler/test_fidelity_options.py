"""The scheduler's fidelity options: frozen_update, warmup_steps, min_train_share,
release_state_after, always_train="task_head"."""
import pytest
import torch
from _models import MLP, bert_batch, regression_data, tiny_bert
from torch import nn

from slimfit.scheduler import ILSScheduler


def _step(model, x, y, opt, sched):
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()


@pytest.mark.parametrize("foreach", [False, True])
def test_momentum_moves_a_frozen_layer_exactly_as_adamw_with_a_zero_gradient(foreach):
    torch.manual_seed(0)
    model = MLP()
    x, y = regression_data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=foreach)
    sched = ILSScheduler(model, 0.6, optimizer=opt, frozen_update="momentum", warmup_steps=0)
    seen_moves = 0
    for _ in range(8):
        frozen = [p for n, p in zip(sched.names, sched.params) if not p.requires_grad]
        # The reference: every frozen parameter with state, stepped by a twin AdamW on a zero gradient.
        twins = []
        for p in frozen:
            if opt.state.get(p):
                twin = nn.Parameter(p.detach().clone())
                twin_opt = torch.optim.AdamW([twin], lr=1e-2, weight_decay=0.1, foreach=foreach)
                twin_opt.state[twin] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
                twin.grad = torch.zeros_like(twin)
                twin_opt.step()
                twins.append((p, twin))
        without_state = [(p, p.detach().clone()) for p in frozen if not opt.state.get(p)]
        _step(model, x, y, opt, sched)
        for p, twin in twins:
            assert torch.equal(p.detach(), twin.detach())
            seen_moves += 1
        for p, before in without_state:          # never trained: no moments to follow
            assert torch.equal(p.detach(), before)
        assert all(p.grad is None for p in model.parameters())  # the zero grads do not outlive the step
    assert seen_moves > 0


def test_default_frozen_layers_do_not_move():
    torch.manual_seed(0)
    model = MLP()
    x, y = regression_data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = ILSScheduler(model, 0.6, optimizer=opt, warmup_steps=0)
    for _ in range(6):
        frozen = {id(p): p.detach().clone() for p in sched.params if not p.requires_grad}
        _step(model, x, y, opt, sched)
        for p in sched.params:
            if id(p) in frozen:
                assert torch.equal(p.detach(), frozen[id(p)])


def test_momentum_with_a_fused_or_other_optimizer_uses_private_zero_grads():
    torch.manual_seed(0)
    model = MLP()
    x, y = regression_data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)
    sched = ILSScheduler(model, 0.6, optimizer=opt, frozen_update="momentum", warmup_steps=0)
    for _ in range(6):
        _step(model, x, y, opt, sched)
    assert sched._guard.momentum_updates > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_release_state_after_drops_moments_of_long_frozen_layers():
    torch.manual_seed(0)
    model = MLP()
    x, y = regression_data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = ILSScheduler(model, 0.6, optimizer=opt, release_state_after=2, warmup_steps=0,
                         min_train_share=0.0)   # the scores alone: some layers stay frozen long
    for _ in range(10):
        _step(model, x, y, opt, sched)
        for i, p in enumerate(sched.params):
            if not sched._trained[i] and sched._age[i] >= 2:
                assert not opt.state.get(p)
    assert any(not opt.state.get(p) for p in sched.params)


def test_warmup_ramps_the_rate():
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])
    sched = ILSScheduler(model, 0.9, warmup_steps=4)
    counts = []
    for _ in range(6):
        counts.append(sched.num_frozen)
        sched.step()
    # rate 0, 0.225, 0.45, 0.675, then 0.9 of 10 layers
    assert counts == [0, 2, 5, 7, 9, 9]


def test_warmup_ramps_from_its_start_rate():
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])
    sched = ILSScheduler(model, 0.9, warmup_steps=4, warmup_start_rate=0.5)
    counts = []
    for _ in range(6):
        counts.append(sched.num_frozen)
        sched.step()
    # rate 0.5, 0.6, 0.7, 0.8, then 0.9 of 10 layers
    assert counts == [5, 6, 7, 8, 9, 9]
    high = ILSScheduler(nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)]), 0.3, warmup_steps=4,
                        warmup_start_rate=0.8)
    assert high.current_rate() == 0.3   # a start above freeze_rate is freeze_rate: no ramp down


def _train_counts(rate, min_share, layers=10, steps=40):
    """Steps each of `layers` equal layers trained in, when layer i always scores higher than layer i-1,
    and the scheduler (built with `min_share`) after the last step."""
    bank = nn.Module()
    bank.w = nn.ParameterList([nn.Parameter(torch.ones(2, 2)) for _ in range(layers)])
    sched = ILSScheduler(bank, rate, min_train_share=min_share, warmup_steps=0)
    sched.apply()
    trained = torch.zeros(layers)
    for _ in range(steps):
        with torch.no_grad():
            for i, p in enumerate(bank.w):
                if p.requires_grad:
                    trained[i] += 1
                    p.mul_(1.0 + 0.001 * (i + 1))   # layer i always scores higher than i-1
        assert sched.num_frozen == round(rate * layers)
        sched.step()
    return trained, sched


def test_min_train_share_guarantees_every_layer_its_share():
    steps, share = 40, 0.05
    plain, _ = _train_counts(0.8, 0.0, steps=steps)
    assert plain.min() < share * steps    # without the floor the low scorers starve
    guarded, _ = _train_counts(0.8, share, steps=steps)
    assert guarded.min() >= share * steps
    assert guarded.sum() == plain.sum()   # same number of trained slots


def test_even_share_is_round_robin():
    """min_train_share="even": every layer trains equally often (within one step), whatever the scores."""
    trained, sched = _train_counts(0.7, "even", steps=40)
    assert trained.sum() == 3 * 40
    assert trained.max() - trained.min() <= 1          # 12 each: 40 steps x 3 slots / 10 layers
    assert sched.state_dict()["config"]["min_train_share"] == "even"
    assert list(sched.train_counts().values()) == trained.long().tolist()


def test_option_errors():
    model = MLP()
    with pytest.raises(ValueError, match="frozen_update"):
        ILSScheduler(model, 0.5, frozen_update="adam")
    with pytest.raises(ValueError, match="warmup_steps"):
        ILSScheduler(model, 0.5, warmup_steps=-1)
    with pytest.raises(ValueError, match="min_train_share"):
        ILSScheduler(model, 0.9, min_train_share=0.2)
    for bad in ("uneven", True):
        with pytest.raises(ValueError, match="min_train_share"):
            ILSScheduler(model, 0.5, min_train_share=bad)
    with pytest.raises(ValueError, match="release_state_after"):
        ILSScheduler(model, 0.5, release_state_after=0)


def test_task_head_stays_out_of_scheduling():
    model = tiny_bert()
    sched = ILSScheduler(model, 0.9, always_train="task_head", warmup_steps=0)
    assert not any(n.startswith("classifier") for n in sched.names)
    model(**bert_batch())
    assert model.classifier.weight.requires_grad
    with pytest.raises(ValueError, match="no task head"):
        ILSScheduler(MLP(), 0.5, always_train="task_head")


def test_state_dict_round_trip_keeps_train_counts():
    model = MLP()
    x, y = regression_data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = ILSScheduler(model, 0.6, optimizer=opt, min_train_share=0.2, warmup_steps=0)
    for _ in range(5):
        _step(model, x, y, opt, sched)
    state = sched.state_dict()
    sched.close()   # a new scheduler schedules the layers that require grad when it is built
    other = ILSScheduler(model, 0.6, min_train_share=0.2, warmup_steps=0)
    other.load_state_dict(state)
    assert torch.equal(other._train_count, sched._train_count)
