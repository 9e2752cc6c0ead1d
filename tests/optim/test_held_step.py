"""Every moment 8-bit between steps on a plain optimizer (FrozenState(between_steps=True) under a ChunkedStep,
SchedulerConfig(frozen_state="compress_all")): the moments are decoded, updated and encoded a piece at a
time, never in full. A step from held moments is torch's step from their decoded values bit for bit; the
entries stay within the codec's bounds of the moments torch's step makes; a resumed run is the same."""
import pytest
import torch
from _optim_models import build, data, loss_of, plain_twin
from torch import nn

from slimfit.optim import ChunkedStep, FrozenState, codec
from slimfit.optim.keys import Q8
from slimfit.scheduler import ILSScheduler
from slimfit.step_memory import measure_step


def _held_setup(chunk=1000, seed=0):
    model = build(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = ChunkedStep(opt, chunk_numel=chunk)
    holder = FrozenState(opt, "compress", between_steps=True, seed=seed, code="linear")   # its bounds: linear
    return model, opt, step, holder


def _step(model, opt, batch):
    loss_of(model, batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_every_moment_is_held_from_the_first_step_and_the_first_step_is_torch_s():
    model, opt, step, _ = _held_setup()
    ref = build(0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    _step(model, opt, data(seed=0))
    _step(ref, ref_opt, data(seed=0))
    # zero moments decode to exactly 0, so the first update is torch's bit for bit
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    for p in model.parameters():
        st = opt.state[p]
        assert set(st) == {"step", "exp_avg" + Q8, "exp_avg_sq" + Q8} and float(st["step"]) == 1
    assert step.pieces_stepped == len(list(model.parameters()))


def test_a_step_from_held_moments_is_torch_s_step_from_their_decoded_values():
    model, opt, _, _ = _held_setup(chunk=1024)     # a multiple of the group: 200x200 weights in 40 pieces
    for s in range(3):
        _step(model, opt, data(seed=s))
    ref, ref_opt = plain_twin(model, opt)
    _step(model, opt, data(seed=3))
    _step(ref, ref_opt, data(seed=3))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    for p, q in zip(model.parameters(), ref.parameters()):   # entries: torch's new moments within the bounds
        for key, sqrt in (("exp_avg", False), ("exp_avg_sq", True)):
            entry, exact = opt.state[p][key + Q8], ref_opt.state[q][key]
            got = codec.decode(entry).view(-1)
            target = exact.sqrt() if sqrt else exact
            got = got.sqrt() if sqrt else got
            steps = entry["scale"].repeat_interleave(entry["group_size"])[: got.numel()]
            assert ((got - target.view(-1)).abs() <= steps * 1.0001 + 1e-12).all(), key


def _scheduled_run(frozen_state, seed=0):
    model = build(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # update_scale="none": the held moments' effect alone (this toy's lr 1e-2 stretched 2x by "share" is too large)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, seed=seed, frozen_state=frozen_state,
                         update_scale="none", warmup_steps=0)
    losses = []
    for s in range(20):
        loss = loss_of(model, data(seed=s % 2))
        losses.append(float(loss))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return losses, opt, sched


# The seeds' spread on this toy (final loss of compress_all over the plain run's, per model seed 0-5, at 1 and
# 2 threads, Intel Xeon): linear8 0.59-1.50 (std 0.27), dynamic8 (the default code) 0.45-1.79 (std 0.36); the
# means' ratio 0.97 / 0.82 (linear8, 1 / 2 threads) and 0.94 / 1.04 (dynamic8). One run's outcome is chaotic
# (LayerNorm's backward sums in another order at 2 threads, and a rounding decision turns that last bit into
# another run), so only the mean over the seeds is compared, with three standard errors of margin:
# 1 + 3 * 0.36 / sqrt(6) = 1.44.
_SEEDS = range(6)
_MEAN_RATIO_MARGIN = 1.44


def test_it_trains_and_the_scheduler_holds_every_layer_with_compress_all():
    """Lossy at every step, yet on this toy it trains as AdamW with the state in full does: over six seeds the
    mean final loss within the seeds' margin above plain's. Accuracy on real tasks: docs/fidelity.md."""
    plain = [_scheduled_run(None, seed)[0] for seed in _SEEDS]
    held = [_scheduled_run("compress_all", seed) for seed in _SEEDS[:-1]]
    losses, opt, sched = _scheduled_run("compress_all", _SEEDS[-1])
    finals = [run[0][-1] for run in held] + [losses[-1]]
    mean_plain, mean_held = (sum(x) / len(x) for x in ([r[-1] for r in plain], finals))
    assert mean_held < 0.4 * sum(r[0] for r in plain) / len(plain)      # it trains: 1.38 -> about 0.3
    assert mean_held <= _MEAN_RATIO_MARGIN * mean_plain, (finals, [r[-1] for r in plain])
    assert all(set(st) <= {"step", "exp_avg" + Q8, "exp_avg_sq" + Q8} for st in opt.state.values())
    sched.close()      # nothing frozen: the holder puts every state back in full
    assert all(type(st["exp_avg"]) is torch.Tensor for st in opt.state.values())


def test_a_resumed_run_is_the_same():
    def run(stop_at=None, steps=6):
        model, opt, _, holder = _held_setup()
        for s in range(steps):
            if s == stop_at:
                ck = {"model": model.state_dict(), "opt": opt.state_dict()}
                model, opt, _, holder = _held_setup()
                model.load_state_dict(ck["model"])
                opt.load_state_dict(ck["opt"])
            _step(model, opt, data(seed=s))
        return model

    a, b = run(), run(stop_at=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_amsgrad_holds_its_maximum_too():
    model = build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    ChunkedStep(opt)
    FrozenState(opt, "compress", between_steps=True)
    for s in range(3):
        _step(model, opt, data(seed=s))
    assert all("max_exp_avg_sq" + Q8 in st and "max_exp_avg_sq" not in st for st in opt.state.values())


def test_it_needs_a_chunked_step_or_the_step_in_backward():
    model = build(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="attach_chunked_step"):
        FrozenState(opt, "compress", between_steps=True)
    with pytest.raises(ValueError, match="attach_chunked_step"):
        ILSScheduler(model, freeze_rate=0.5, optimizer=opt, frozen_state="compress_all")
    with pytest.raises(ValueError, match="attach_chunked_step"):
        FrozenState(opt, "offload", between_steps=True)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ChunkedStep(plain)   # its chunked step streams moments held on the host too (tests/optim/test_host_state.py)
    assert FrozenState(plain, "offload", between_steps=True).between_steps


def test_no_moment_is_ever_in_full():
    """A 4.9 MiB embedding: its two fp32 moments would be 9.8 MiB; held, the state is 2.6 MiB and the
    optimizer step's rise above what the step found resident stays near the chunk's few temporaries."""
    class Emb(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20000, 64)

        def forward(self, ids):
            return self.emb(ids)

    torch.manual_seed(0)
    model = Emb()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ChunkedStep(opt, chunk_numel=1 << 16)
    holder = FrozenState(opt, "compress", between_steps=True, code="linear")
    ids = torch.randint(0, 20000, (6, 7), generator=torch.Generator().manual_seed(0))
    model(ids).square().mean().backward()    # the state exists, as in every later step
    opt.step()
    opt.zero_grad(set_to_none=True)
    run = measure_step(model, lambda: model(ids).square().mean(), opt, loss_fn=lambda out: out)
    numel = 20000 * 64
    assert run.optimizer_state <= 2 * codec.encoded_nbytes(numel) + 64
    grad = numel * 4
    assert run.phase_peaks["optimizer"] - run.resident <= grad + 8 * (1 << 16) * 4
    assert holder.held_nbytes() == 2 * codec.encoded_nbytes(numel)


def _closure_run(seed: int, frozen_state) -> float:
    """Ten steps of torch's step with a closure under the scheduler; the loss after them over the loss before."""
    model = build(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, seed=seed, frozen_state=frozen_state, warmup_steps=0,
                         update_scale="none")   # (this toy's lr stretched 2x is too large: see _scheduled_run)
    first = float(loss_of(model, data()))
    for s in range(10):
        batch = data(seed=s % 2)

        def closure(batch=batch):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model, batch)
            loss.backward()
            return loss

        opt.step(closure)
        opt.zero_grad(set_to_none=True)
        sched.step()
        if frozen_state is not None:
            assert all(set(st) <= {"step", "exp_avg" + Q8, "exp_avg_sq" + Q8} for st in opt.state.values())
    return float(loss_of(model, data())) / first


# Loss after / before over model seeds 0-5 (1 and 2 threads alike, Intel Xeon): held in the default code
# (dynamic8) 0.47-0.59, in linear8 0.42-0.71, the state in full 0.47-0.66; per seed, held over full: dynamic8
# 0.90-1.13 (mean 1.02), linear8 0.91-1.47 (mean 1.09, std 0.22). Margin on the means' ratio: three standard
# errors of the wider code, 1 + 3 * 0.22 / sqrt(6) = 1.27.
_CLOSURE_MARGIN = 1.27


def test_a_step_with_a_closure_puts_the_moments_back_for_torch_s_step():
    """torch steps from the moments put back in full and they are held again after it (no full moment left
    between steps), and the run trains as the same closure run with the state in full does, over six seeds."""
    held = [_closure_run(seed, "compress_all") for seed in _SEEDS]
    full = [_closure_run(seed, None) for seed in _SEEDS]
    assert sum(held) / len(held) < 0.75 and sum(full) / len(full) < 0.75
    assert sum(held) / sum(full) < _CLOSURE_MARGIN


class _Emb(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20000, 64)

    def forward(self, ids):
        return self.emb(ids).square().mean()


def _held_run(in_backward: bool, steps: int = 3):
    """Three steps of the held 8-bit AdamW over one 20000 x 64 embedding, stepped a piece at a time by a
    ChunkedStep: by a plain optimizer's step, or inside backward (step_in_backward's per-parameter one)."""
    from slimfit.optim import step_in_backward

    model = _Emb()
    opt = step_in_backward(model, torch.optim.AdamW, lr=1e-2) if in_backward else \
        torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = ChunkedStep(opt, chunk_numel=1 << 16)
    holder = FrozenState(opt, "compress", between_steps=True, seed=3)
    for s in range(steps):
        ids = torch.randint(0, 20000, (6, 7), generator=torch.Generator().manual_seed(s))
        model(ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, step, holder


def test_the_step_in_backward_steps_held_moments_a_piece_at_a_time():
    """Inside backward too, a held parameter's moments are decoded, stepped and encoded a piece at a time, never
    whole: the same weights and codes, bit for bit, as the plain optimizer's chunked held step (one parameter:
    the same pieces and seeds), and backward's rise over the resident bytes near the gradient and a few pieces."""
    plain_model, plain_opt, _, plain_holder = _held_run(False)
    model, opt, step, holder = _held_run(True)
    assert step.pieces_stepped == 3
    assert torch.equal(model.emb.weight, plain_model.emb.weight)
    (p,), (q,) = list(model.parameters()), list(plain_model.parameters())
    for key in ("exp_avg" + Q8, "exp_avg_sq" + Q8):
        assert torch.equal(codec.decode(opt.state[p][key]), codec.decode(plain_opt.state[q][key]))
    ids = torch.randint(0, 20000, (6, 7), generator=torch.Generator().manual_seed(9))
    run = measure_step(model, lambda: model(ids), opt, loss_fn=lambda out: out)
    numel = 20000 * 64
    assert run.phase_peaks["backward"] - run.resident <= numel * 4 + 8 * (1 << 16) * 4
    assert holder.held_nbytes() == plain_holder.held_nbytes() < 2.2 * numel   # two 8-bit moments: 2 bytes a parameter
