"""The chunked optimizer step on a CUDA device (run with: pytest -m gpu): torch's foreach AdamW (CUDA's
default) bit for bit, its temporaries bounded by the chunk instead of every trained parameter at once, the
scheduler's in-step scores (sums kept on the device) against the snapshot path, and every state 8-bit."""
import pytest
import torch
from _optim_models import build, data, loss_of

from slimfit.optim import ChunkedStep
from slimfit.optim.keys import Q8
from slimfit.scheduler import ILSScheduler

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")


def _batch(seed=0):
    return tuple(t.to(CUDA) for t in data(seed=seed))


def _loop(model, opt, steps, sched=None):
    for s in range(steps):
        loss_of(model, _batch(s % 2)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("foreach", [True, False])
def test_foreach_and_single_tensor_adamw_bit_for_bit(foreach):
    a, b = build(0).to(CUDA), build(0).to(CUDA)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1, foreach=foreach)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, foreach=foreach)
    step = ChunkedStep(ob, chunk_numel=4096)
    _loop(a, oa, 4)
    _loop(b, ob, 4)
    assert step.pieces_stepped > 0
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        assert all(torch.equal(oa.state[p][k], ob.state[q][k]) for k in oa.state[p])


def test_the_foreach_temporaries_are_bounded_by_the_chunk():
    """foreach AdamW's sqrt temporaries span every parameter of the step; chunked, a few chunks."""
    def step_peak(chunked):
        model = build(0, d=1024, depth=4).to(CUDA)       # 4 M parameters in the hidden layers
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        _loop(model, opt, 1)
        if chunked:
            ChunkedStep(opt, chunk_numel=1 << 16)
        loss_of(model, _batch()).backward()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        opt.step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    params = sum(p.numel() for p in build(0, d=1024, depth=4).parameters())
    plain, chunked = step_peak(False), step_peak(True)
    assert plain >= 4 * params * 0.9                       # a temporary the size of every parameter
    assert chunked <= 8 * (1 << 16) * 4 + (1 << 20)


def test_in_step_scores_match_the_snapshot_path_and_no_snapshot_is_made():
    def run(chunk):
        model = build(0).to(CUDA)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, seed=0, frozen_state=None,
                             step_chunk_numel=chunk)
        scores, snaps = [], []
        for s in range(6):
            loss_of(model, _batch(s % 2)).backward()
            opt.step()
            snaps.append(len(sched._snap))
            opt.zero_grad(set_to_none=True)
            sched.step()
            scores.append(sched._scores.clone())
        return scores, snaps, sched

    ref, _, _ = run(None)
    got, snaps, sched = run(1 << 15)
    assert sched._chunked_step is not None and all(n == 0 for n in snaps)
    for a, b in zip(ref, got):   # the device sums add in another order: equal up to rounding
        assert torch.allclose(a, b, rtol=1e-5, atol=0)


def test_every_state_8_bit_trains_on_the_device():
    model = build(0).to(CUDA)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, seed=0, frozen_state="compress_all")
    first = float(loss_of(model, _batch()))
    _loop(model, opt, 20, sched)
    assert float(loss_of(model, _batch())) < 0.25 * first
    assert all(st[k + Q8]["codes"].device.type == "cuda" for st in opt.state.values()
               for k in ("exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("state_code", ["dynamic8", "dynamic4"])
def test_the_held_ops_scores_on_the_device_match_the_cpu_run(state_code):
    """Every moment held (the default's compress_all), the same gradients given on both devices: on the device the
    Triton op steps the pieces and sums their scores itself (fused_held_step.SCORES_IN_OP), on the CPU the C++ op
    steps them and the scores come from copies. The kernels are their reference bit for bit, so the weights are
    the same bits; the scores are the same to float rounding (summed in another order), the frozen sets the same,
    and the device path copies no weight."""
    from slimfit.optim import held_step

    def run(device):
        torch.manual_seed(0)
        model = build(0).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, seed=0, frozen_state="compress_all",
                             state_code=state_code, warmup_steps=0)
        g = torch.Generator().manual_seed(1)
        scores, sets = [], []
        for _ in range(6):
            for p in model.parameters():
                grad = torch.randn(p.shape, generator=g) * 1e-2
                p.grad = grad.to(device) if p.requires_grad else None
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            scores.append(sched._scores.clone().cpu())
            sets.append(tuple(sched.frozen_names()))
        return scores, sets, [p.detach().cpu() for p in model.parameters()]

    copies = []
    original = held_step.copies
    held_step.copies = lambda pieces: copies.append(pieces[0].device.type) or original(pieces)
    try:
        cpu_scores, cpu_sets, cpu_weights = run("cpu")
        cuda_scores, cuda_sets, cuda_weights = run(CUDA)
    finally:
        held_step.copies = original
    assert "cpu" in copies and "cuda" not in copies
    assert cpu_sets == cuda_sets
    assert all(torch.equal(a, b) for a, b in zip(cpu_weights, cuda_weights))
    for a, b in zip(cpu_scores, cuda_scores):
        assert torch.allclose(a, b, rtol=1e-5, atol=0)
