"""The bf16 decoder trained as slimfit trains: patched, scheduled (ILSScheduler's defaults: rate 0.7, every
layer's AdamW moments held 8-bit, the chunked step), ten steps. Loss falls, the layers the scheduler trained at
a step moved and the frozen ones did not, the held moments decode finite, the scores are finite. With the
scheduler off (rate 0, no held state) the chunked step is torch's AdamW on the bf16 weights bit for bit.
fp16 weights: the same loop as a smoke test."""
from __future__ import annotations

import math

import pytest
import torch
from _bf16_decoder import batch, build_decoder, clone

import slimfit
from slimfit.optim import decode
from slimfit.optim.chunked_step import for_optimizer
from slimfit.optim.keys import Q8

STEPS = 10
LR = 1e-2   # above half a bf16 ulp of every weight up to 1.0 (2**-8): every update shows


def _train(model, opt, sched, ids, steps=STEPS):
    """``steps`` steps; per step the names that had a gradient at opt.step() and those that moved."""
    losses, log = [], []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        had_grad = {n for n, p in model.named_parameters() if p.grad is not None}
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        if sched is not None:
            sched.step()
        losses.append(float(loss.detach()))
        log.append((had_grad, moved))
    return losses, log


# fp16: eps must be representable in fp16 moments (its smallest normal is 6.1e-5; 1e-8 rounds to 0 and the
# first update is inf / NaN, as with torch's own step: test_fp16_default_eps_warns); lr 1e-3 is above half an
# fp16 ulp (2**-11) of weights up to 1.0.
@pytest.mark.parametrize("dtype,hyper", [(torch.bfloat16, {"lr": LR}), (torch.float16, {"lr": 1e-3, "eps": 1e-4})])
def test_scheduler_defaults_train_the_low_precision_decoder(dtype, hyper):
    model = slimfit.patch(build_decoder(dtype), slimfit.SlimFitConfig.paper())
    opt = torch.optim.AdamW(model.parameters(), **hyper)
    sched = slimfit.ILSScheduler(model, optimizer=opt)
    assert sched.config.frozen_state_mode == "compress_all" and for_optimizer(opt) is not None
    losses, log = _train(model, opt, sched, batch())
    assert losses[-1] < losses[0] and all(math.isfinite(x) for x in losses)
    frozen_any = False
    for had_grad, moved in log:
        assert moved == had_grad          # trained ones moved, frozen ones (no gradient) stood still
        frozen_any |= len(had_grad) < len(list(model.parameters()))
    assert frozen_any and for_optimizer(opt).pieces_stepped > 0
    held = 0
    for p in model.parameters():
        assert p.dtype == dtype and torch.isfinite(p).all()
        for key, entry in opt.state.get(p, {}).items():
            if key.endswith(Q8):
                m = decode(entry)
                assert m.dtype == dtype and m.shape == p.shape and torch.isfinite(m).all()
                held += 1
    assert held >= 2 * len(sched.names)   # every scheduled layer's two moments are held
    assert all(math.isfinite(s) for s in sched.layer_scores().values())


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_chunked_step_is_torch_adamw_on_bf16_weights_bit_for_bit(foreach, weight_decay):
    """Scheduler off (rate 0, frozen_state None), pieces of 4096 elements (every matrix split, small
    parameters packed), the weights rounded to nearest as torch rounds them (weight_rounding="nearest"; the
    default, "auto", rounds them stochastically): weights and moments equal plain AdamW's on the bf16 model
    after every step."""
    base = slimfit.patch(build_decoder(), slimfit.SlimFitConfig.paper())
    ids = batch()
    ref, got = clone(base), clone(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=weight_decay, foreach=foreach)
    opt = torch.optim.AdamW(got.parameters(), lr=LR, weight_decay=weight_decay, foreach=foreach)
    sched = slimfit.ILSScheduler(got, optimizer=opt, freeze_rate=0.0, frozen_state=None, step_chunk_numel=4096,
                                 weight_rounding="nearest")
    for _ in range(4):
        _train(ref, ref_opt, None, ids, steps=1)
        _train(got, opt, sched, ids, steps=1)
        for (name, a), b in zip(ref.named_parameters(), got.parameters()):
            assert torch.equal(a, b), name
            for key, t in ref_opt.state[a].items():
                assert torch.equal(t, opt.state[b][key]), (name, key)
    assert for_optimizer(opt).pieces_stepped > 0


def test_fp16_default_eps_warns_where_torchs_own_step_gives_nan():
    """torch's AdamW on fp16 weights with eps=1e-8: NaN after one step (moments in fp16); the chunked step does
    the same arithmetic, so it says why and what to change instead of failing silently."""
    ids = batch()
    plain = build_decoder(torch.float16)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    _train(plain, opt, None, ids, steps=1)
    assert not all(torch.isfinite(p).all() for p in plain.parameters())
    model = slimfit.patch(build_decoder(torch.float16), slimfit.SlimFitConfig.paper())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = slimfit.ILSScheduler(model, optimizer=opt)
    with pytest.warns(UserWarning, match="float16 weights with eps=1e-08.*eps >= 1e-4, bfloat16 weights"):
        _train(model, opt, sched, ids, steps=1)
