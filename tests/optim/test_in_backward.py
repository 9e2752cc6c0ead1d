"""step_in_backward: the weights after N steps are those of a plain loop with the same optimizer.

Bit-identical, not within a tolerance: every optimizer here updates each parameter from that parameter's own
gradient and state only (torch's foreach and fused AdamW apply the same per-tensor arithmetic whether they
get one tensor or many; torchao's and bitsandbytes' 8-bit AdamW quantize per parameter, in blocks that never
span two parameters), and the post-accumulate-grad hook fires once the gradient is complete, after every
backward node that reads the parameter. So nothing in the arithmetic differs, only when it runs.
"""
import io

import pytest
import torch
from _optim_models import build, data, loss_of, manual_schedule, matrices, train, weights

from slimfit.optim import attach_frozen_state, step_in_backward
from slimfit.scheduler import ILSScheduler


def _torchao():
    try:
        from torchao.optim import AdamW8bit
    except Exception as e:  # noqa: BLE001 - any import failure means: not usable here
        pytest.skip(f"torchao is not installed or does not import ({type(e).__name__}: {e}); pip install torchao")
    return AdamW8bit, {"lr": 1e-2, "weight_decay": 0.1}


def _bitsandbytes():
    try:
        from bitsandbytes.optim import AdamW8bit
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"bitsandbytes is not installed or does not import ({type(e).__name__}: {e}); "
                    "pip install bitsandbytes")
    return AdamW8bit, {"lr": 1e-2, "weight_decay": 0.1, "min_8bit_size": 1024}


OPTIMIZERS = {
    "adamw-for-loop": lambda: (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": False}),
    "adamw-foreach": lambda: (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": True}),
    "adamw-fused": lambda: (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
    "adam-amsgrad": lambda: (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    "sgd-momentum": lambda: (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "torchao-adamw8bit": _torchao,
    "bitsandbytes-adamw8bit": _bitsandbytes,
}


def _run_8bit_or_skip(fn):
    """An 8-bit optimizer that imports but cannot run on this machine's CPU is skipped with its error."""
    try:
        return fn()
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"does not run on this CPU: {type(e).__name__}: {str(e)[:200]}")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_weights_equal_a_plain_loop_with_changing_frozen_sets(name):
    cls, kwargs = OPTIMIZERS[name]()
    small = {"d": 64, "depth": 2} if "8bit" in name else {}   # 8-bit: fewer shapes for torchao to compile
    batch = data()
    plain_model, model = build(0, **small), build(0, **small)
    plain = cls(plain_model.parameters(), **kwargs)
    opt = step_in_backward(model, cls, **kwargs)
    before = weights(model)

    def both():
        train(plain_model, plain, batch, 5)
        train(model, opt, batch, 5)
    _run_8bit_or_skip(both) if "8bit" in name else both()
    assert all(torch.equal(a, b) for a, b in zip(weights(plain_model), weights(model)))
    assert all(not torch.equal(a, b) for a, b in zip(weights(model), before))   # everything trained sometime


def test_tied_weight_steps_once_with_both_contributions():
    batch = data()
    plain_model, model = build(0, tied=True), build(0, tied=True)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    opt = step_in_backward(model, torch.optim.AdamW, lr=1e-2)
    train(plain_model, plain, batch, 4)
    train(model, opt, batch, 4)
    assert all(torch.equal(a, b) for a, b in zip(weights(plain_model), weights(model)))


def test_with_the_scheduler_same_decisions_and_weights():
    batch = data()
    plain_model, model = build(0), build(0)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2, weight_decay=0.1)
    opt = step_in_backward(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    # the frozen layers' state 8-bit on both (the default holds every layer's, which the two loops encode in
    # pieces of different sizes: the chunked step's and one parameter's)
    plain_sched = ILSScheduler(plain_model, freeze_rate=0.5, optimizer=plain, frozen_state="compress", warmup_steps=0)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, frozen_state="compress", warmup_steps=0)
    for _ in range(6):
        train(plain_model, plain, batch, 1, sched=plain_sched)
        train(model, opt, batch, 1, sched=sched)
        assert plain_sched.frozen_names() == sched.frozen_names()
    assert sched.skipped_steps == 0 and sched.step_count == 6
    assert all(torch.equal(a, b) for a, b in zip(weights(plain_model), weights(model)))


def test_with_compressed_frozen_state_same_weights_as_a_plain_loop_with_it():
    """FrozenState draws its seeds in the scheduler's order, so both loops round the same way."""
    batch = data()
    plain_model, model = build(0), build(0)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    opt = step_in_backward(model, torch.optim.AdamW, lr=1e-2)
    plain_sched = ILSScheduler(plain_model, freeze_rate=0.5, optimizer=plain, frozen_state=None, warmup_steps=0)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, frozen_state=None, warmup_steps=0)
    plain_held = attach_frozen_state(plain_sched, plain)
    held = attach_frozen_state(sched, opt)
    train(plain_model, plain, batch, 8, sched=plain_sched)
    train(model, opt, batch, 8, sched=sched)
    assert held.held_nbytes() == plain_held.held_nbytes() > 0
    assert all(torch.equal(a, b) for a, b in zip(weights(plain_model), weights(model)))


def test_gradients_are_freed_inside_backward():
    model = build(0)
    opt = step_in_backward(model, torch.optim.AdamW, lr=1e-2)
    manual_schedule(model, 0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    loss_of(model, data()).backward()
    assert all(p.grad is None for p in model.parameters())
    assert opt.param_steps == len(trainable) < len(list(model.parameters()))


def test_parameters_frozen_when_it_is_built_train_later():
    model = build(0)
    w = matrices(model)[1]
    w.requires_grad_(False)
    opt = step_in_backward(model, torch.optim.AdamW, lr=1e-2)
    assert not w.requires_grad
    before = w.detach().clone()
    w.requires_grad_(True)
    loss_of(model, data()).backward()
    assert not torch.equal(before, w) and float(opt.state[w]["step"]) == 1


def test_clipping_is_refused_with_the_reason():
    model = build(0)
    with pytest.raises(ValueError, match="total norm"):
        step_in_backward(model, torch.optim.AdamW, lr=1e-3, max_grad_norm=1.0)
    opt = step_in_backward(model, torch.optim.AdamW, lr=1e-3)
    with pytest.raises(RuntimeError, match="total norm"):
        opt.clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(TypeError, match="optimizer_class"):
        step_in_backward(model, "AdamW")
    with pytest.raises(NotImplementedError):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


def test_step_updates_parameters_that_still_hold_a_gradient():
    model = build(0)
    opt = step_in_backward(model, torch.optim.SGD, lr=1.0)
    b = model.out.bias
    before = b.detach().clone()
    b.grad = torch.ones_like(b)
    opt.step()
    assert torch.equal(b, before - 1) and b.grad is None


def _through_a_file(state_dict):
    """A checkpoint's copy: a live state_dict shares its tensors (torch's load keeps an fp32 moment as is)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def test_state_dict_round_trip_and_lr_scheduler():
    batch = data()
    model, twin = build(0), build(0)
    opt = step_in_backward(model, torch.optim.AdamW, lr=1e-2)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    train(model, opt, batch, 2, schedule=None)
    lr_sched.step()
    assert all(o.param_groups[0]["lr"] == 5e-3 for o in opt.optimizers.values())
    twin.load_state_dict(model.state_dict())
    twin_opt = step_in_backward(twin, torch.optim.AdamW, lr=1.0)
    twin_opt.load_state_dict(_through_a_file(opt.state_dict()))
    assert all(o.param_groups[0]["lr"] == 5e-3 for o in twin_opt.optimizers.values())
    train(model, opt, batch, 2, schedule=None)
    train(twin, twin_opt, batch, 2, schedule=None)
    assert all(torch.equal(a, b) for a, b in zip(weights(model), weights(twin)))


def test_remove_gives_plain_gradients_back():
    model = build(0)
    opt = step_in_backward(model, torch.optim.AdamW, lr=1e-2)
    opt.remove()
    loss_of(model, data()).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_checkpoint_with_held_frozen_state():
    """An in-backward optimizer with compressed frozen state saves and loads it as held 8-bit entries."""
    batch = data()
    model, twin = build(0), build(0)
    opt = step_in_backward(model, torch.optim.AdamW, lr=1e-2)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, frozen_state=None, warmup_steps=0)
    held = attach_frozen_state(sched, opt)
    train(model, opt, batch, 3, sched=sched)
    twin.load_state_dict(model.state_dict())
    twin_opt = step_in_backward(twin, torch.optim.AdamW, lr=1e-2)
    twin_sched = ILSScheduler(twin, freeze_rate=0.5, optimizer=twin_opt, frozen_state=None, warmup_steps=0)
    twin_sched.load_state_dict(sched.state_dict())
    twin_held = attach_frozen_state(twin_sched, twin_opt)
    twin_opt.load_state_dict(_through_a_file(opt.state_dict()))
    assert twin_held.held_nbytes() == held.held_nbytes() > 0
    twin_params = dict(zip(map(id, model.parameters()), twin.parameters()))
    for p in held.held_params():
        a, b = opt.state[p], twin_opt.state[twin_params[id(p)]]
        ea, eb = a["exp_avg@slimfit_q8"], b["exp_avg@slimfit_q8"]
        assert all(torch.equal(v, eb[k]) for k, v in ea.items() if isinstance(v, torch.Tensor))
    train(model, opt, batch, 2, sched=sched)
    train(twin, twin_opt, batch, 2, sched=twin_sched)
    assert all(torch.equal(a, b) for a, b in zip(weights(model), weights(twin)))


def test_model_and_optimizer_are_freed_when_dropped():
    """The parameters' hooks hold the optimizer weakly: a strong hook made a cycle through the tensors' C++
    hook tables that gc never frees (on a GPU every earlier model stayed allocated)."""
    import gc
    import weakref

    model = build(0)
    opt = step_in_backward(model, torch.optim.AdamW, lr=1e-2)
    train(model, opt, data(), 2)
    model_ref, opt_ref = weakref.ref(model), weakref.ref(opt)
    del model, opt
    gc.collect()
    assert model_ref() is None and opt_ref() is None


def test_dropping_the_optimizer_removes_its_hooks():
    """A model that outlives its in-backward optimizer gets plain gradients again (no update, nothing lost)."""
    import gc

    model = build(0)
    opt = step_in_backward(model, torch.optim.AdamW, lr=1e-2)
    del opt
    gc.collect()
    before = weights(model)
    loss_of(model, data()).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(weights(model), before))
