"""weight_rounding="stochastic": the chunked step writes bf16 / fp16 weights by stochastic rounding of the
fp32 update (slimfit/optim/weight_rounding.py). Where round to nearest loses an update (below half an ulp of
the weight), stochastic rounding moves the weight by one ulp with the probability that makes the expected
weight the fp32 result; seeded and deterministic; fp32 weights unchanged by the option."""
from __future__ import annotations

import math

import pytest
import torch
from _bf16_decoder import batch, build_decoder

import slimfit
from slimfit.optim import attach_chunked_step
from slimfit.optim.weight_rounding import round_stochastic

N_SEEDS, N_ELEMS, DELTA = 256, 512, 1e-6
LR = 1e-4   # Adam's first update is lr·sign(g): 1e-4, far below half a bf16 ulp of [1, 2) (2**-8 = 0.0039)


def _hoeffding(n_draws: int, n_elems: int, delta: float = DELTA) -> float:
    """Bound t (in ulps) on |mean of n_draws roundings − x| for every one of n_elems elements together, with
    probability ≥ 1 − delta: each draw lies in an interval one ulp wide, so Hoeffding gives
    P(|mean − x| ≥ t·ulp) ≤ 2·exp(−2·n_draws·t²) per element, and a union bound over the elements."""
    return math.sqrt(math.log(2 * n_elems / delta) / (2 * n_draws))


def _ulp(w: torch.Tensor) -> torch.Tensor:
    """The gap from |w| to the next larger value of w's dtype, in fp32."""
    up = torch.nextafter(w.abs(), torch.full_like(w, math.inf))
    return (up.float() - w.abs().float())


def _weights(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = (1 + torch.rand(N_ELEMS, generator=gen)).to(dtype)     # in [1, 2]: one ulp everywhere but at 2
    g = torch.randn(N_ELEMS, generator=gen)
    # |g| >= 0.1: (1 - beta2)·g² stays a normal fp16 number, so fp16's moments hold v (eps 1e-4, _step)
    return w, (g.sign() * (0.1 + g.abs())).to(dtype)


def _step(w, g, rounding, seed, lr=LR):
    p = torch.nn.Parameter(w.clone())
    p.grad = g.clone()
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=0.0, eps=1e-4)   # representable in fp16
    step = attach_chunked_step(opt, chunk_numel=128, weight_rounding=rounding, seed=seed)
    opt.step()
    assert step.pieces_stepped == 1 and p.grad is None
    return p.detach()


def _fp32_update(w, g, lr=LR):
    p = torch.nn.Parameter(w.float())
    p.grad = g.float()
    torch.optim.AdamW([p], lr=lr, weight_decay=0.0, eps=1e-4).step()
    return p.detach()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_moves_what_nearest_loses_and_its_mean_is_the_fp32_update(dtype):
    w, g = _weights(dtype)
    lr = LR if dtype == torch.bfloat16 else LR / 8    # fp16's ulp in [1, 2) is 2**-10: below half of it too
    x = _fp32_update(w, g, lr)
    assert torch.equal(_step(w, g, "nearest", 0, lr), w)          # round to nearest: every update lost
    draws = torch.stack([_step(w, g, "stochastic", s, lr).float() for s in range(N_SEEDS)])
    moved = draws != w.float()
    assert moved.any(dim=0).float().mean() > 0.5                 # most elements moved in some draw
    ulp = _ulp(w)
    lower, upper = torch.minimum(w.float(), x), torch.maximum(w.float(), x)
    assert ((draws >= lower - ulp) & (draws <= upper + ulp)).all()   # one of x's two neighbours
    err = (draws.mean(0) - x).abs() / ulp
    assert float(err.max()) <= _hoeffding(N_SEEDS, N_ELEMS)   # 0.20 ulp at 256 draws, 512 elements (measured 0.022)
    # the bias over every draw of every element: the mean of N_SEEDS·N_ELEMS errors, each in one ulp
    bias = float(((draws.mean(0) - x) / ulp).mean())
    assert abs(bias) <= _hoeffding(N_SEEDS * N_ELEMS, 1)   # 0.0074 ulp; truncation would be off by 0.0127


def test_seeded_and_deterministic():
    w, g = _weights(torch.bfloat16)
    a, b = _step(w, g, "stochastic", 3), _step(w, g, "stochastic", 3)
    assert torch.equal(a, b) and not torch.equal(a, _step(w, g, "stochastic", 4))


def test_fp32_weights_unchanged_by_the_option():
    w, g = _weights(torch.float32)
    assert torch.equal(_step(w, g, "stochastic", 0, lr=1e-3), _step(w, g, "nearest", 0, lr=1e-3))


def test_round_stochastic_keeps_representable_and_nonfinite_values():
    x = torch.tensor([1.0, -2.5, 0.0, math.inf, -math.inf, math.nan, 1e30])
    for dtype in (torch.bfloat16, torch.float16):
        out = round_stochastic(x, dtype, seed=1)
        near = x.to(dtype)
        assert out.dtype == dtype
        assert torch.equal(out[:5], near[:5]) and out[5].isnan() and torch.equal(out[6], near[6])
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        round_stochastic(x, torch.float32, seed=1)


def test_scheduler_option_moves_the_norms_nearest_leaves_still():
    """The bf16 decoder under the scheduler's defaults (every moment held 8-bit), lr 1e-3: the RMSNorm weights
    (all 1.0) trained every step never move with round to nearest (1e-3 < 2**-8); with the option they do."""
    ids = batch()
    moved = {}
    for rounding in ("nearest", "stochastic"):
        model = slimfit.patch(build_decoder(), slimfit.SlimFitConfig.paper())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = slimfit.ILSScheduler(model, optimizer=opt, weight_rounding=rounding)
        for _ in range(5):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        moved[rounding] = int((model.model.norm.weight != 1).sum())
        assert all(torch.isfinite(p).all() for p in model.parameters())
    assert moved["nearest"] == 0 and moved["stochastic"] > 0


def test_the_default_rounds_bf16_weights_stochastically():
    """ILSScheduler's default (weight_rounding="auto") moves the weights that nearest rounding leaves where they
    are, as "stochastic" does, bit for bit."""
    ids = batch()
    weights = {}
    for rounding in ("auto", "stochastic"):
        model = slimfit.patch(build_decoder(), slimfit.SlimFitConfig.paper())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = slimfit.ILSScheduler(model, optimizer=opt, seed=3, **({} if rounding == "auto" else
                                                                     {"weight_rounding": rounding}))
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        weights[rounding] = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(weights["auto"], weights["stochastic"]))


def test_config_checks():
    """The default, "auto", is stochastic under the chunked step and nearest without it; a config saved
    without the field rounds to nearest, as that run did."""
    config = slimfit.SchedulerConfig()
    assert config.weight_rounding == "auto" and config.effective_weight_rounding == "stochastic"
    assert slimfit.SchedulerConfig(step_chunk_numel=None).effective_weight_rounding == "nearest"
    saved = config.to_dict()
    del saved["weight_rounding"]
    assert slimfit.SchedulerConfig.from_dict(saved).effective_weight_rounding == "nearest"
    with pytest.raises(ValueError, match="weight_rounding must be one of"):
        slimfit.SchedulerConfig(weight_rounding="sr")
    with pytest.raises(ValueError, match="weight_rounding must be 'nearest' when step_chunk_numel is None"):
        slimfit.SchedulerConfig(weight_rounding="stochastic", step_chunk_numel=None)
