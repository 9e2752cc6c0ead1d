"""SchedulerConfig.optimizer_state, given by its older name frozen_state: the scheduler holds the optimizer state
through slimfit.optim (slimfit/optim/attach.py, imported when an optimizer is attached)."""
import pytest
import torch
from _optim_models import build, data, train

from slimfit.optim.keys import HOST, Q8
from slimfit.scheduler import ILSScheduler, SchedulerConfig


def _held(opt, p, suffix):
    return "exp_avg" + suffix in opt.state.get(p, {}) and "exp_avg" not in opt.state[p]


@pytest.mark.parametrize("mode,suffix", [("compress", Q8), ("offload", HOST)])
def test_frozen_state_option_holds_the_frozen_layers_state(mode, suffix):
    model = build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, frozen_state=mode, warmup_steps=0)
    for _ in range(4):
        train(model, opt, data(), 1, sched=sched)
        for p in sched.params:
            if opt.state.get(p):  # frozen layers hold it, trained layers have it as AdamW made it
                assert _held(opt, p, suffix) == (not p.requires_grad)
    assert any(_held(opt, p, suffix) for p in sched.params)
    sched.close()  # every state back
    assert not any(_held(opt, p, suffix) for p in sched.params)


def test_attaching_again_replaces_the_holder():
    model = build(0)
    first, second = (torch.optim.AdamW(model.parameters(), lr=1e-2) for _ in range(2))
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=first, frozen_state="compress", warmup_steps=0)
    train(model, first, data(), 2, sched=sched)
    assert any(_held(first, p, Q8) for p in sched.params)
    sched.attach_optimizer(second)
    assert not any(_held(first, p, Q8) for p in sched.params)  # the old optimizer's state put back


def test_frozen_state_option_checked():
    with pytest.raises(ValueError, match="did you mean 'compress'"):
        SchedulerConfig(frozen_state="compres")
    with pytest.raises(ValueError, match="keep one"):
        SchedulerConfig.from_options(frozen_state="compress", frozen_update="momentum")
    config = SchedulerConfig(frozen_state="offload")
    assert SchedulerConfig.from_dict(config.to_dict()).frozen_state == "offload"


def test_auto_compresses_every_state_unless_momentum_reads_it():
    """The default (docs/fidelity.md): every layer's moments 8-bit where the optimizer's step can hold them (a
    torch AdamW under the chunked step), the frozen layers' only where it cannot (another optimizer)."""
    assert SchedulerConfig().frozen_state == "auto"
    assert SchedulerConfig().frozen_state_mode == "compress_all"
    assert SchedulerConfig(frozen_state=None).frozen_state_mode is None
    momentum = SchedulerConfig.from_options(frozen_state="auto", frozen_update="momentum")   # no conflict
    assert momentum.frozen_state_mode is None
    for options, held in (({"frozen_state": "auto"}, "all"), ({}, "all"), ({"frozen_state": None}, "none"),
                          ({"frozen_state": "auto", "frozen_update": "momentum"}, "none"),
                          ({"frozen_state": "compress"}, "frozen")):
        model = build(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, warmup_steps=0, **options)
        train(model, opt, data(), 3, sched=sched)
        got = [_held(opt, p, Q8) for p in sched.params]
        trained = [p.requires_grad for p in sched.params]
        expected = {"all": [True] * len(got), "none": [False] * len(got),
                    "frozen": [not t for t in trained]}[held]
        assert got == expected, options
    model = build(0)
    opt = torch.optim.NAdam(model.parameters(), lr=1e-2)   # no chunked step: the frozen layers'
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, warmup_steps=0)
    train(model, opt, data(), 3, sched=sched)
    assert not sched._frozen_state.between_steps
    assert [_held(opt, p, Q8) for p in sched.params] == [not p.requires_grad for p in sched.params]


def test_a_config_without_the_field_holds_nothing():
    """A config saved before the field existed resumes as that run did."""
    old = SchedulerConfig(frozen_state="compress").to_dict()
    del old["optimizer_state"]   # saved under optimizer_state's name
    assert SchedulerConfig.from_dict(old).frozen_state is None
    assert SchedulerConfig.from_dict(SchedulerConfig(frozen_state="auto").to_dict()).frozen_state == "auto"


def test_a_second_holder_on_a_scheduler_that_holds_the_state_is_refused():
    from slimfit.optim import attach_frozen_state

    model = build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, frozen_state="compress")
    with pytest.raises(ValueError, match="already holds.*frozen_state=None"):
        attach_frozen_state(sched, opt, mode="offload")
    sched.close()


def test_resumed_run_rounds_as_the_uninterrupted_one():
    """frozen_state="compress" with stochastic rounding: a run checkpointed and resumed in new objects makes
    the same decisions and ends with the same weights, bit for bit (seeds follow the optimizer's state)."""
    import io

    def setup(init_seed):
        model = build(init_seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, ILSScheduler(model, freeze_rate=0.5, optimizer=opt, frozen_state="compress", warmup_steps=0)

    model, opt, sched = setup(0)
    train(model, opt, data(), 8, sched=sched)
    reference = [p.detach().clone() for p in model.parameters()]
    model, opt, sched = setup(0)
    train(model, opt, data(), 4, sched=sched)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    model, opt, sched = setup(123)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    train(model, opt, data(), 4, sched=sched)
    for p, q in zip(model.parameters(), reference):
        assert torch.equal(p, q)


