"""The held step through slimfit::adam_blockwise_ (slimfit/optim/fused_held_step.py): the default 8-bit dynamic
entries of a plain AdamW are stepped by one op per call. Against the unfused round (decode, torch's Adam, encode):
the same step to fp32 rounding; its draws do not depend on how the parameters are cut into pieces; it trains, in
fp32 and bf16 weights; what it leaves to the unfused round."""
import copy

import pytest
import torch
from _optim_models import build, data, loss_of
from torch.utils._python_dispatch import TorchDispatchMode

from slimfit.optim import ChunkedStep, FrozenState, held_step
from slimfit.optim.fused_held_step import fusable
from slimfit.optim.keys import Q8

_NO_LAUNCH = ("aten.slice", "aten.view", "aten.detach", "aten.alias", "aten.as_strided", "profiler.")


class _Count(TorchDispatchMode):
    """The ops of a step that would launch a kernel on a GPU (views and profiler marks left out)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if not name.startswith(_NO_LAUNCH):
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def _setup(chunk=1024, stochastic=True, dtype=torch.float32, rounding="nearest", amsgrad=False, seed=0, bits=8):
    model = build(seed).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    step = ChunkedStep(opt, chunk_numel=chunk, weight_rounding=rounding, seed=seed)
    holder = FrozenState(opt, "compress", between_steps=True, seed=seed, code="dynamic", bits=bits,
                         stochastic=stochastic)
    return model, opt, (step, holder)


def _train(model, opt, steps, first=0, same_batch=False):
    losses = []
    for s in range(first, first + steps):
        x, y = data(seed=first if same_batch else s)
        loss = loss_of(model, (x.to(next(model.parameters()).dtype), y.to(next(model.parameters()).dtype)))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _entries(opt):
    return [opt.state[p][k + Q8][part] for g in opt.param_groups for p in g["params"]
            for k in ("exp_avg", "exp_avg_sq") for part in ("codes", "absmax")]


def test_one_step_is_the_unfused_rounds_to_fp32_rounding(monkeypatch):
    """From the same held state (nearest rounding, so no draw differs), one fused step and one unfused step give
    the same weights to a few fp32 ulps (torch's Adam rounds in its own order) and nearly every code the same."""
    model, opt, _keep = _setup(stochastic=False)
    _train(model, opt, 3)
    twin, twin_opt, _keep2 = _setup(stochastic=False)
    twin.load_state_dict(model.state_dict())
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))   # not the live step counts
    _train(model, opt, 1, first=3)
    monkeypatch.setattr(held_step, "FUSED", False)
    _train(twin, twin_opt, 1, first=3)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    codes = [(a, b) for a, b in zip(_entries(opt), _entries(twin_opt)) if a.dtype == torch.uint8]
    differ = sum(int((a != b).sum()) for a, b in codes) / sum(a.numel() for a, _ in codes)
    assert differ < 0.01


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype,rounding", [(torch.float32, "nearest"), (torch.bfloat16, "stochastic")])
def test_the_cut_into_pieces_changes_no_bit(dtype, rounding, bits):
    """Pieces of 128 or of 4096 elements: the same weights and entries after five steps, bit for bit (the draws
    are of each element's place in its parameter; the unfused round's stream runs on from a call's first piece)."""
    runs = []
    for chunk in (128, 4096):
        model, opt, _keep = _setup(chunk=chunk, dtype=dtype, rounding=rounding, bits=bits)
        _train(model, opt, 5)
        runs.append(([p.detach().clone() for p in model.parameters()], _entries(opt)))
    for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype,rounding", [(torch.float32, "nearest"), (torch.bfloat16, "stochastic")])
def test_it_trains_as_the_unfused_round_does(dtype, rounding, bits, monkeypatch):
    """Thirty steps on one batch: the fused run's loss falls as the unfused run's, within twice the spread of
    the unfused runs over three seeds of the held codes' rounding."""
    def final(seed, fused):
        monkeypatch.setattr(held_step, "FUSED", fused)
        model, opt, _keep = _setup(dtype=dtype, rounding=rounding, seed=seed, bits=bits)
        return _train(model, opt, 30, same_batch=True)
    fused = final(0, True)
    unfused = [final(s, False)[-1] for s in range(3)]
    spread = max(unfused) - min(unfused)
    assert fused[-1] < 0.5 * fused[0]
    assert min(unfused) - 2 * spread <= fused[-1] <= max(unfused) + 2 * spread


@pytest.mark.parametrize("bits", [8, 4])
def test_one_op_steps_a_call_and_nothing_is_decoded(bits):
    """A step of the MLP's 12 held parameters (134 pieces of at most 1024) is three ops: the step counts read
    (one stack), one adam_blockwise_, the step counts moved (one foreach add); no dequantize or quantize. The
    unfused round takes tens of ops a call."""
    def count(fused):
        held_step.FUSED = fused
        try:
            model, opt, _keep = _setup(bits=bits)
            _train(model, opt, 2)
            x, y = data(seed=9)
            loss_of(model, (x, y)).backward()
            with _Count() as c:
                opt.step()
            return c.names
        finally:
            held_step.FUSED = True
    fused, unfused = count(True), count(False)
    assert sorted(fused) == ["aten._foreach_add_", "aten.stack", "slimfit.adam_blockwise_"]
    assert len(unfused) > 100


def test_what_it_leaves_to_the_unfused_round():
    model, opt, _keep = _setup(amsgrad=True)
    _train(model, opt, 1)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    states = [opt.state[p] for p in params]
    assert not fusable(opt, opt.param_groups[0], states, params)          # amsgrad
    model, opt, _keep = _setup()
    _train(model, opt, 1)
    for p in params:
        p.grad = None
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    states = [opt.state[p] for p in params]
    group = opt.param_groups[0]
    assert fusable(opt, group, states, params)
    assert not fusable(opt, {**group, "lr": torch.tensor(1e-2)}, states, params)
    assert not fusable(opt, {**group, "maximize": True}, states, params)
    opt.grad_scale = torch.tensor(1.0)
    assert not fusable(opt, group, states, params)
