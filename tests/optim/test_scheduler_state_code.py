"""SchedulerConfig.state_code reaches the held moments: "dynamic8" / "dynamic4" hold every layer's AdamW moments
(compress_all) or the frozen layers' (compress) in block-wise dynamic codes, "linear8" in per-group min/max codes;
a held step is torch's step from the decoded moments whatever the code (tests/optim/test_codec_dynamic.py)."""
import pytest
import torch
from _optim_models import build, data, loss_of

from slimfit.optim import codec
from slimfit.optim.keys import Q8
from slimfit.scheduler import ILSScheduler, SchedulerConfig


def _entries(state_code, frozen_state="compress_all", steps=3):
    model = build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, seed=0, frozen_state=frozen_state,
                         state_code=state_code, warmup_steps=0)
    for s in range(steps):
        loss_of(model, data(seed=s)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return [v for st in opt.state.values() for k, v in st.items() if k.endswith(Q8)], sched


@pytest.mark.parametrize("state_code,code,bits", [("linear8", "linear", 8), ("dynamic8", "dynamic", 8),
                                                  ("dynamic4", "dynamic", 4)])
@pytest.mark.parametrize("frozen_state", ["compress_all", "compress"])
def test_the_held_entries_are_coded_as_state_code_says(state_code, code, bits, frozen_state):
    entries, sched = _entries(state_code, frozen_state)
    assert entries and all(codec.is_encoded(e) for e in entries)
    assert {(codec.code_of(e)["code"], codec.code_of(e)["bits"]) for e in entries} == {(code, bits)}
    assert sched.config.state_code == state_code


def test_a_bad_state_code_is_named_with_the_choices():
    with pytest.raises(ValueError, match=r"SchedulerConfig.state_code must be one of .*did you mean 'dynamic8'"):
        SchedulerConfig(state_code="dynamic_8")
    assert SchedulerConfig.from_dict(SchedulerConfig(state_code="dynamic4").to_dict()).state_code == "dynamic4"


def test_a_scheduler_whose_optimizer_was_dropped_steps_and_closes():
    """ILSScheduler(model, optimizer=torch.optim.AdamW(...)) with no other reference: the optimizer is collected,
    and the scheduler's frozen sets and close() carry on without it (no state is left to hold)."""
    import gc

    model = build(0)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    gc.collect()
    sched.apply()
    sched.close()
    assert all(p.requires_grad for p in model.parameters())


def test_the_default_code_follows_a_moment_that_changes_slowly_when_encoded_every_step():
    """compress_all encodes every moment again at every step. The default linear code rounds stochastically
    (unbiased), so a second moment that decays by beta2 while its block's largest entry is held up still
    decays (nearest rounding would hold it at 1e-4: test_dynamic8_follows_a_moment_that_changes_slowly...)."""
    from slimfit.scheduler.config import STATE_CODES

    code, bits = STATE_CODES[SchedulerConfig().state_code]
    v = torch.full((128,), 1e-4)
    for step in range(500):
        v = v * 0.999
        v[0] = 1.0
        v = codec.decode(codec.encode(v, sqrt=True, seed=step, code=code, bits=bits))
    exact = 1e-4 * 0.999 ** 500
    assert abs(float(v[1:].mean()) - exact) < 0.1 * exact


def _encoded_every_step(kind: str, stochastic: bool, blocks: int, steps: int = 500) -> tuple[float, float]:
    """compress_all's round trip, with dynamic8: each step the moment changes by a factor (v decays by
    beta2 = 0.999; m grows to twice its value over the steps) while each block's largest entry is held at 1,
    and is encoded and decoded again (seed: the step). (mean of the other entries, the exact value)."""
    n = 128 * blocks
    x, factor = (torch.full((n,), 1e-4), 0.999) if kind == "v" else (torch.full((n,), 1e-3), 2 ** (1 / steps))
    top = torch.arange(0, n, 128)
    for step in range(steps):
        x = x * factor
        x[top] = 1.0
        x = codec.decode(codec.encode(x, sqrt=kind == "v", seed=step, code="dynamic", bits=8, stochastic=stochastic))
    rest = torch.ones(n, dtype=torch.bool)
    rest[top] = False
    exact = 1e-4 * 0.999**steps if kind == "v" else 2e-3
    return float(x[rest].mean()), exact


@pytest.mark.parametrize("kind", ["v", "m"])
def test_dynamic8_follows_a_moment_that_changes_slowly_when_encoded_every_step(kind):
    """The dynamic code rounds stochastically (unbiased), so a second moment decaying by beta2 (1e-4 to 6.06e-5
    over 500 steps) and a first moment growing slowly (1e-3 to 2e-3) follow the exact values within 10% over
    8 blocks (measured: 6.15e-5 and 2.00e-3); nearest rounding holds both where they started, since one step's
    change is far below half a gap of the map there (2.8e-4 and 5.6e-4 of the block's absmax)."""
    held, exact = _encoded_every_step(kind, True, blocks=8)
    assert abs(held - exact) < 0.1 * exact
    stuck, _ = _encoded_every_step(kind, False, blocks=8, steps=100)
    start = 1e-4 if kind == "v" else 1e-3
    assert abs(stuck - start) < 1e-3 * start


def test_held_step_with_dynamic8_follows_a_decaying_second_moment():
    """Through the held step compress_all uses (ChunkedStep + FrozenState(between_steps=True), code "dynamic"):
    AdamW with lr 0, one column with gradient 1 (its v stays 1: each block's absmax) and the rest without, so
    their v decays by beta2 from 1e-4 for 500 steps. The per-step seeds (seed_for: the step count) keep the
    rounding unbiased and the mean follows 6.06e-5 within 10% (measured 6.09e-5); stochastic=False holds it at
    1e-4."""
    from slimfit.optim import ChunkedStep, FrozenState

    def run(stochastic: bool, steps: int) -> float:
        p = torch.nn.Parameter(torch.zeros(8, 128))
        opt = torch.optim.AdamW([p], lr=0.0, weight_decay=0.0)
        ChunkedStep(opt, chunk_numel=512)
        FrozenState(opt, "compress", between_steps=True, seed=0, code="dynamic", bits=8, stochastic=stochastic)
        v0 = torch.full((8, 128), 1e-4)
        v0[:, 0] = 1.0
        opt.state[p] = {"step": torch.tensor(1000.0), "exp_avg": torch.zeros(8, 128), "exp_avg_sq": v0}
        grad = torch.zeros(8, 128)
        grad[:, 0] = 1.0
        for _ in range(steps):
            p.grad = grad.clone()
            opt.step()
        assert codec.is_encoded(opt.state[p]["exp_avg_sq" + Q8])
        return float(codec.decode(opt.state[p]["exp_avg_sq" + Q8])[:, 1:].mean())

    exact = 1e-4 * 0.999**500
    assert abs(run(True, 500) - exact) < 0.1 * exact
    assert abs(run(False, 100) - 1e-4) < 1e-7


def test_the_nearest_state_codes_hold_their_moments_rounded_to_nearest():
    """state_code="dynamic8-nearest" reaches FrozenState as the dynamic code with stochastic=False, and
    "dynamic8" with stochastic rounding: the scheduler's choice is the codec's rounding."""
    import torch
    from torch import nn

    from slimfit.scheduler import ILSScheduler

    for state_code, stochastic in (("dynamic8-nearest", False), ("dynamic8", True), ("linear8", True)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, state_code=state_code)
        holder = sched.state_holder
        assert holder is not None and holder.stochastic is stochastic, state_code
        sched.close()
