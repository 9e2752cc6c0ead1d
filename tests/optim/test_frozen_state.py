"""FrozenState: held optimizer state of frozen layers, through the scheduler's frozen-set hook."""
import weakref

import pytest
import torch
from _optim_models import build, data, frozen_params, loss_of, matrices, train, weights

from slimfit.optim import FrozenState, attach_frozen_state, codec, held_state_dict, restore_state
from slimfit.optim.keys import HOST, Q8
from slimfit.scheduler import ILSScheduler


def _setup(mode="compress", rate=0.5, seed=0, **sched_options):
    model = build(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = ILSScheduler(model, freeze_rate=rate, optimizer=opt, frozen_state=None, warmup_steps=0, **sched_options)
    frozen_state = attach_frozen_state(sched, opt, mode=mode, seed=seed, code="linear")   # the bounds below: linear
    return model, opt, sched, frozen_state


def _check_invariant(opt, sched, suffix):
    """Every frozen layer with state holds it (no plain moment); every trained layer has plain moments."""
    frozen = {id(p) for p in frozen_params(sched)}
    for p in sched.params:
        st = opt.state.get(p)
        if not st:
            continue
        if id(p) in frozen:
            assert "exp_avg" not in st and "exp_avg_sq" not in st
            assert {"exp_avg" + suffix, "exp_avg_sq" + suffix} <= set(st)
        else:
            assert type(st["exp_avg"]) is torch.Tensor and type(st["exp_avg_sq"]) is torch.Tensor


@pytest.mark.parametrize("mode,suffix", [("compress", Q8), ("offload", HOST)])
def test_frozen_layers_hold_state_and_trained_layers_have_it(mode, suffix):
    model, opt, sched, frozen_state = _setup(mode)
    batch = data()
    for _ in range(6):
        frozen_before = {id(p): p.detach().clone() for p in frozen_params(sched)}
        loss_of(model, batch).backward()
        opt.step()
        for p in frozen_params(sched):
            assert torch.equal(p, frozen_before[id(p)])   # frozen weights stand still
        opt.zero_grad()
        sched.step()
        _check_invariant(opt, sched, suffix)
    assert frozen_state.held_params()
    sched.close()   # nothing frozen: every state back
    assert not frozen_state.held_params()
    assert all("exp_avg" in opt.state[p] for p in sched.params)


def test_restored_state_within_the_stated_bounds():
    """A hook registered before FrozenState's sees each state as it freezes; when the layer trains again its
    restored state is within codec.py's bounds of it (nothing stepped it in between)."""
    model = build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, frozen_state=None, warmup_steps=0)
    before, checked = {}, []

    def record(frozen, trained):
        for p in frozen:
            st = opt.state.get(p)
            if st and "exp_avg" in st:
                before[id(p)] = (st["exp_avg"].clone(), st["exp_avg_sq"].clone())
    sched.register_frozen_set_hook(record)
    attach_frozen_state(sched, opt, code="linear")
    batch = data()
    for _ in range(8):
        held = {id(p) for p in frozen_params(sched) if any(k.endswith(Q8) for k in opt.state.get(p, {}))}
        train(model, opt, batch, 1, sched=sched)
        for p in sched.params:
            if id(p) in held and p.requires_grad:
                m, v = before[id(p)]
                _assert_within_bounds(opt.state[p], m, v)
                checked.append(p)
    assert checked, "no layer went from frozen with state to trained in 8 steps"


def _assert_within_bounds(state, m, v):
    step_m = codec.encode(m, sqrt=False, seed=0)["scale"].max()
    step_s = codec.encode(v, sqrt=True, seed=0)["scale"]
    s, s_hat = v.sqrt(), state["exp_avg_sq"].sqrt()
    assert (state["exp_avg"] - m).abs().max() <= step_m * 1.001 + 1e-6 * m.abs().max()
    assert (s_hat - s).abs().max() <= step_s.max() * 1.001 + 1e-6 * s.max()
    assert (s_hat >= s / 2 * (1 - 1e-6)).all()


def test_offload_is_lossless_and_frees_the_device_tensors():
    """CPU path: the "host" copy is a separate storage (no saving on a CPU), the state tensor is dropped
    from the optimizer, and the trajectory is bit-identical to plain AdamW under the same schedule."""
    batch = data()
    ref_model = build(0)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    train(ref_model, ref_opt, batch, 8, sched=ILSScheduler(ref_model, freeze_rate=0.5, optimizer=ref_opt,
                                                           frozen_state=None, warmup_steps=0))
    model, opt, sched, frozen_state = _setup("offload")
    train(model, opt, batch, 2, sched=sched)
    p = frozen_params(sched)[0]
    st = opt.state[p]
    st["exp_avg"] = st.pop("exp_avg" + HOST)   # thawed by hand, to watch the storages
    alive, storage = weakref.ref(st["exp_avg"]), st["exp_avg"].untyped_storage().data_ptr()
    assert frozen_state.freeze([p]) == 1       # held again: the tensor leaves the optimizer and is freed
    assert alive() is None and st["exp_avg" + HOST].untyped_storage().data_ptr() != storage
    train(model, opt, batch, 6, sched=sched)
    sched.close()
    assert all(torch.equal(a, b) for a, b in zip(weights(model), weights(ref_model)))


class RecordingTransfer:
    """A CpuTransfer that logs its calls, to check the order of copies and waits."""

    def __init__(self, log):
        self.log = log

    def to_host(self, t):
        self.log.append("out")
        return t.clone()

    def to_device(self, host, device):
        self.log.append("back")
        return host.clone(), object()

    def wait(self, ticket):
        self.log.append("wait")

    def synchronize(self):
        self.log.append("sync")


def test_offload_copies_back_at_the_scheduler_step_and_waits_before_the_optimizer_step():
    """Copies back are issued when the scheduler picks the next trained set; nothing waits during forward and
    backward; the optimizer step waits once per parameter brought back, before it updates anything."""
    model, opt, sched, frozen_state = _setup("offload")
    log = []
    frozen_state._transfers[torch.device("cpu")] = RecordingTransfer(log)
    opt.register_step_post_hook(lambda *args: log.append("step"))
    batch, brought_back = data(), 0
    for _ in range(8):
        log.clear()
        sched_step_pending = len(frozen_state._pending)
        loss_of(model, batch).backward()
        assert log == []
        opt.step()
        assert log == ["wait"] * sched_step_pending + ["step"]
        opt.zero_grad()
        log.clear()
        sched.step()
        assert "wait" not in log and log.count("back") == 2 * len(frozen_state._pending)
        brought_back += len(frozen_state._pending)
    assert brought_back > 0
    opt.state_dict()
    assert log[-1] == "sync"


def test_a_held_parameter_with_a_gradient_is_restored_before_the_step():
    """A frozen set changed by hand (not through the scheduler): the step pre-hook restores it first."""
    model = build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = data()
    train(model, opt, batch, 1, schedule=None)
    frozen_state = FrozenState(opt)
    w = matrices(model)[1]
    assert frozen_state.freeze([w]) == 1
    train(model, opt, batch, 1, schedule=None)   # w has a gradient: restored, then stepped
    assert "exp_avg" in opt.state[w] and float(opt.state[w]["step"]) == 2


def test_momentum_update_is_refused():
    model = build(0)
    opt = torch.optim.AdamW(model.parameters())
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, frozen_update="momentum")
    with pytest.raises(ValueError, match="momentum"):
        attach_frozen_state(sched, opt)


def test_release_state_after_drops_held_state():
    model, opt, sched, frozen_state = _setup("compress", release_state_after=2, min_frozen_steps=3)
    train(model, opt, data(), 6, sched=sched)
    long_frozen = {id(p) for p in frozen_params(sched) if p not in opt.state}
    assert long_frozen and not long_frozen & {id(p) for p in frozen_state.held_params()}


def test_checkpoint_round_trip_keeps_the_held_entries_exactly():
    model, opt, sched, frozen_state = _setup("compress")
    batch = data()
    train(model, opt, batch, 3, sched=sched)
    sd = opt.state_dict()
    held = frozen_state.held_params()
    model2, opt2, sched2, frozen_state2 = _setup("compress")
    model2.load_state_dict(model.state_dict())
    sched2.load_state_dict(sched.state_dict())
    opt2.load_state_dict(sd)
    params2 = dict(zip(map(id, model.parameters()), model2.parameters()))
    for p in held:
        a, b = opt.state[p]["exp_avg_sq" + Q8], opt2.state[params2[id(p)]]["exp_avg_sq" + Q8]
        assert b["codes"].dtype == torch.uint8 and all(torch.equal(a[k], b[k]) for k in ("codes", "scale", "offset"))
    plain = torch.optim.AdamW(build(0).parameters())   # the slimfit-only format: restore_state decodes by hand
    plain.load_state_dict(held_state_dict(opt))
    assert restore_state(plain) == len(held)
    assert all(type(st["exp_avg_sq"]) is torch.Tensor for st in plain.state.values())


def test_bad_options():
    opt = torch.optim.AdamW(build(0).parameters())
    for bad in (dict(mode="zip"), dict(group_size=0), dict(seed=-1)):
        with pytest.raises(ValueError):
            FrozenState(opt, **bad)


def test_eight_bit_optimizer_state_is_left_alone_by_compress_and_moved_by_offload():
    """bitsandbytes' AdamW8bit keeps uint8 state1/state2: compress leaves it (already 8-bit), offload moves it
    and brings it back unchanged (weights bit-identical to the same run without offload)."""
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install bitsandbytes)")
    batch = data()
    runs = {}
    for mode in (None, "compress", "offload"):
        model = build(0)
        opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=1024)
        sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, frozen_state=None, warmup_steps=0)
        held = attach_frozen_state(sched, opt, mode=mode) if mode else None
        train(model, opt, batch, 6, sched=sched)
        if mode == "compress":   # every scheduled matrix is over min_8bit_size: nothing left to compress
            assert len(held.held_params()) == 0 and held.held_nbytes() == 0
        if mode == "offload":
            assert any("state1" + HOST in opt.state[p] for p in held.held_params())
        runs[mode] = weights(model)
    assert all(torch.equal(a, b) for a, b in zip(runs[None], runs["offload"]))


def test_zero_filled_gradients_of_frozen_layers_cost_no_round_trip():
    """FrozenState's step hook registered before the scheduler's guard, and code that hands out zero-filled
    gradients on every parameter: a frozen, held layer reaches the step with a zero gradient. It must stand
    still and keep its entry as it is (not decoded and encoded again every step)."""
    model = build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    frozen_state = FrozenState(opt)                       # its step pre-hook runs before the guard's
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, frozen_state=None, warmup_steps=0)
    frozen_state.attach(sched)
    batch = data()
    for _ in range(6):
        entries = {id(p): opt.state[p]["exp_avg" + Q8] for p in frozen_state.held_params()}
        frozen = {id(p): p.detach().clone() for p in frozen_params(sched)}
        loss_of(model, batch).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=False)
        for p in frozen_params(sched):
            assert torch.equal(p, frozen[id(p)])
            if id(p) in entries:
                assert opt.state[p]["exp_avg" + Q8] is entries[id(p)]
        sched.step()
    assert entries


def _in_backward_run(between: bool, steps: int = 20):
    from slimfit.optim import step_in_backward

    model = build(0)
    opt = step_in_backward(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    frozen_state = FrozenState(opt, "compress", between_steps=True) if between else None
    batch, losses = data(), []
    for _ in range(steps):
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if between:  # after a step nothing is resident in full: every moment held 8-bit
            assert all("exp_avg" not in st and "exp_avg" + Q8 in st for st in opt.state.values())
    return losses, frozen_state, opt   # FrozenState holds its optimizer weakly: the caller keeps it


def test_between_steps_holds_every_state_and_still_trains():
    """between_steps=True: every parameter's moments are held 8-bit between its own steps (back in full only
    for its step inside backward). Lossy at every step, yet it trains as AdamW does here: its final loss no more
    than 1.5x plain AdamW's (measured 0.81x after 20 steps: 0.0185 vs 0.0228 from 1.38); the accuracy protocols
    have not measured it yet."""
    losses, frozen_state, _opt = _in_backward_run(True)
    plain, _, _ = _in_backward_run(False)
    assert losses[-1] < 0.05 * losses[0]
    assert losses[-1] <= 1.5 * plain[-1]
    frozen_state.remove()
    assert not frozen_state.held_params()


def test_between_steps_needs_the_step_in_backward():
    model = build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="step_in_backward"):
        FrozenState(opt, "compress", between_steps=True)


def test_a_holder_nobody_keeps_lives_as_long_as_its_optimizer():
    """FrozenState holds its optimizer weakly (no cycle through the optimizer's hooks); the hooks keep it: a
    holder dropped by its caller still puts the state back before a step that needs it, and goes with the
    optimizer."""
    import gc

    model = build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = data()
    train(model, opt, batch, 1, schedule=lambda m, s: None)     # every parameter has state
    held = weakref.ref(FrozenState(opt))
    held().freeze(matrices(model))
    gc.collect()
    assert held() is not None and any(k.endswith(Q8) for k in opt.state[matrices(model)[0]])
    train(model, opt, batch, 1, schedule=lambda m, s: None)     # a step with their gradients: restored first
    assert all("exp_avg" in opt.state[p] and not any(k.endswith(Q8) for k in opt.state[p]) for p in matrices(model))
    del opt
    gc.collect()
    assert held() is None
