"""With an attached torch AdamW (the default step_chunk_numel) the scheduler scores its trained layers inside
the chunked optimizer step: no weight snapshot exists at any moment, and scores and frozen sets are those
of the snapshot path bit for bit on the CPU, with a plain optimizer and with the step in backward."""
import math

import pytest
import torch
from _models import regression_data
from torch import nn

from slimfit.optim import step_in_backward
from slimfit.scheduler import ILSScheduler
from slimfit.scheduler.scores import BLOCK_NUMEL, NAIVE_SCORES, BlockSums

STEPS = 8


class Wide(nn.Module):
    """Weight matrices larger than a score block (65,536 and 73,728 entries): several pieces each."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 256)
        self.mid = nn.Linear(256, 256)
        self.mid2 = nn.Linear(256, 288)
        self.head = nn.Linear(288, 1)

    def forward(self, x):
        return self.head(torch.relu(self.mid2(torch.relu(self.mid(torch.relu(self.inp(x)))))))


def _run(chunk, in_backward=False, score="relative", steps=STEPS, opt_kwargs=None, opt_cls=torch.optim.AdamW,
         update_scale="none", frozen_state=None):
    torch.manual_seed(0)
    model = Wide()
    kwargs = dict(lr=1e-2, weight_decay=0.1, **(opt_kwargs or {}))
    opt = step_in_backward(model, opt_cls, **kwargs) if in_backward else opt_cls(model.parameters(), **kwargs)
    # update_scale="none" by default here: the stretch rounds otherwise inside the step than after it (tested
    # below, to a few ulps)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, seed=0, frozen_state=frozen_state, score=score,
                         step_chunk_numel=chunk, update_scale=update_scale, warmup_steps=0)
    history, snaps = [], []
    for step in range(steps):
        x, y = regression_data(seed=step % 3)
        loss = nn.functional.mse_loss(model(x), y)
        snaps.append(len(sched._snap))
        loss.backward()
        snaps.append(len(sched._snap))
        opt.step()
        snaps.append(len(sched._snap))
        opt.zero_grad(set_to_none=True)
        sched.step()
        history.append((sched._scores.clone(), tuple(sched.frozen_names())))
    return history, snaps, sched, model


def _same(a, b):
    return all(torch.equal(sa, sb) and fa == fb for (sa, fa), (sb, fb) in zip(a, b))


@pytest.mark.parametrize("score", ["relative", "robust"])
@pytest.mark.parametrize("in_backward", [False, True], ids=["plain", "in_backward"])
def test_scores_and_frozen_sets_are_the_snapshot_path_bit_for_bit_and_no_snapshot_exists(score, in_backward):
    snapshot, _, snap_sched, m1 = _run(None, in_backward, score)
    in_step, snaps, sched, m2 = _run(BLOCK_NUMEL, in_backward, score)      # 2-3 pieces per weight matrix
    assert snap_sched._chunked_step is None and sched._chunked_step is not None
    assert sched._chunked_step.pieces_stepped > 0
    assert _same(snapshot, in_step)
    assert all(n == 0 for n in snaps)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))
    assert len({tuple(f) for _, f in in_step}) > 1                        # the frozen set did change


def test_a_fused_optimizer_is_scored_in_step_too():
    snapshot, _, _, _ = _run(None, opt_kwargs={"fused": True})
    in_step, snaps, sched, _ = _run(BLOCK_NUMEL, opt_kwargs={"fused": True})
    assert sched._chunked_step is not None and all(n == 0 for n in snaps)
    assert _same(snapshot, in_step)


class _OwnAdamW(torch.optim.AdamW):
    """A subclass may change the step: the chunked step leaves it alone."""


def test_an_optimizer_it_cannot_take_keeps_the_snapshots():
    snapshot, _, _, _ = _run(None, opt_cls=_OwnAdamW)
    kept, snaps, sched, _ = _run(BLOCK_NUMEL, opt_cls=_OwnAdamW)
    assert sched._chunked_step is None                 # nothing it could take: not attached
    assert _same(snapshot, kept)
    assert any(n > 0 for n in snaps)


def _run_share(chunk, frozen_state=None, steps=STEPS):
    return _run(chunk, steps=steps, update_scale="share",
                frozen_state=frozen_state)


def test_update_scale_share_stretches_inside_the_chunked_step_without_snapshots():
    """The chunked step runs a trained layer's update at lr times its catch-up factor: the weights the snapshot
    path's stretch makes (to rounding, checked early: lr * f inside the step against p + (f - 1) * update after it), its
    frozen sets, and no snapshot at any moment. Scores of the unscaled update: the same to rounding while the
    weights are (the first two steps; later the relative score's 1 / |W| magnifies the weights' last bits)."""
    snapshot, _, snap_sched, m1 = _run_share(None)
    in_step, snaps, sched, m2 = _run_share(BLOCK_NUMEL)
    _, _, _, early1 = _run_share(None, steps=2)
    _, _, _, early2 = _run_share(BLOCK_NUMEL, steps=2)
    assert snap_sched._chunked_step is None and sched._chunked_step is not None and all(n == 0 for n in snaps)
    assert [f for _, f in snapshot] == [f for _, f in in_step]
    assert len({f for _, f in in_step}) > 1
    for (a, _), (b, _) in zip(snapshot[:2], in_step[:2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
    for p, q in zip(early1.parameters(), early2.parameters()):   # one stretched step: a few ulps
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)
    assert max(sched.train_counts().values()) < STEPS     # a layer sat out steps: some update was stretched


def test_update_scale_share_stretches_held_moments_too():
    """Every moment 8-bit (compress_all): the held step stretches the update by the same factor."""
    history, snaps, sched, model = _run_share(BLOCK_NUMEL, frozen_state="compress_all")
    assert sched._frozen_state is not None and all(n == 0 for n in snaps)
    plain, _, _, _ = _run_share(BLOCK_NUMEL)
    assert [f for _, f in history][:2] == [f for _, f in plain][:2]   # lossy after: the same early decisions


def test_mid_step_checkpoint_carries_the_sums_and_bad_sums_are_refused():
    history, _, _, _ = _run(BLOCK_NUMEL, steps=4)
    torch.manual_seed(0)
    model = Wide()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, seed=0, frozen_state=None,
                         step_chunk_numel=BLOCK_NUMEL, update_scale="none", warmup_steps=0)   # as _run
    for step in range(4):
        x, y = regression_data(seed=step % 3)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 3:   # written between the optimizer's step and the scheduler's
            state = sched.state_dict(include_snapshots=True)
            assert "snapshots" in state and not state["snapshots"] and state["in_step_sums"]
            sched._sums.clear()
            sched.load_state_dict(state)
            opt.step()   # as a resumed loop's optimizer step would be counted (no gradients: no update)
        sched.step()
    assert torch.equal(sched._scores, history[-1][0]) and tuple(sched.frozen_names()) == history[-1][1]

    frozen = [n for n in sched.names if n not in sched.trained_names()][0]
    bad = dict(state, in_step_sums={frozen: [1.0, 2.0, 0.0]})
    with pytest.raises(ValueError, match="not a layer this state trains"):
        sched.load_state_dict(bad)
    trained = sched.trained_names()[0]
    bad = dict(state, in_step_sums={trained: [1.0, "x", 0.0]})
    with pytest.raises(ValueError, match="three numbers"):
        sched.load_state_dict(bad)


@pytest.mark.parametrize("kind", ["relative", "robust", "absolute"])
@pytest.mark.parametrize("host", [True, False], ids=["host", "device_sums"])
def test_block_sums_over_pieces_equal_the_whole_tensor_formula(kind, host):
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3 * BLOCK_NUMEL + 123, generator=g)
    old[::7] = 0.0                                     # zeros in W_old: the zero-aware relative score
    new = old + 1e-3 * torch.randn(old.shape, generator=g)
    sums = BlockSums(kind, old.dtype, host=host)
    for a in range(0, old.numel(), 2 * BLOCK_NUMEL):
        sums.add(old[a:a + 2 * BLOCK_NUMEL], new[a:a + 2 * BLOCK_NUMEL])
    expected = NAIVE_SCORES[kind](old, new)
    assert math.isclose(sums.value(), expected, rel_tol=1e-6)
    again = BlockSums(kind, old.dtype).restore(sums.sums())
    assert again.value() == sums.value()


def test_block_sums_of_a_layer_that_is_all_zero():
    old = torch.zeros(100)
    moved, still = BlockSums("relative", old.dtype), BlockSums("relative", old.dtype, host=False)
    moved.add(old, old + 1.0)
    still.add(old, old)
    assert moved.value() == math.inf and still.value() == 0.0


def test_the_summary_says_what_is_attached():
    _, _, sched, _ = _run(BLOCK_NUMEL, steps=1)
    assert "optimizer: chunked step (32,768 elements a call)" in sched.summary()
    assert "state as the optimizer keeps it" in sched.summary()
    _, _, sched, _ = _run(BLOCK_NUMEL, steps=1, opt_cls=_OwnAdamW)
    assert "its own step, layers scored against weight snapshots" in sched.summary()
    torch.manual_seed(0)
    model = Wide()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for mode, text in (("compress", "frozen layers' state 8-bit"), ("compress_all", "every layer's state 8-bit")):
        sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, frozen_state=mode)
        assert text in sched.summary()
        sched.close()


def test_a_step_with_a_closure_is_torch_s_and_scored_against_snapshots():
    """A closure makes the gradients inside torch's step, after the chunked step's hook: torch steps every
    parameter, once, and the scheduler snapshots the trained layers before it (the same run as without)."""
    def run(chunk):
        torch.manual_seed(0)
        model = Wide()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, seed=0, frozen_state=None,
                             step_chunk_numel=chunk, warmup_steps=0)
        history = []
        for step in range(4):
            x, y = regression_data(seed=step % 3)
            nn.functional.mse_loss(model(x), y).backward()    # gradients before the step, as well

            def closure(x=x, y=y):
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss

            opt.step(closure)
            opt.zero_grad(set_to_none=True)
            sched.step()
            history.append((sched._scores.clone(), tuple(sched.frozen_names())))
        return history, model

    (a, ma), (b, mb) = run(None), run(BLOCK_NUMEL)
    assert _same(a, b)
    assert all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))


@pytest.mark.parametrize("kind", ["relative", "absolute", "robust"])
def test_device_sums_of_a_step_are_read_to_the_host_together(kind):
    """The device path (BlockSums(host=False): a GPU's) keeps each optimizer call's sums on the device; the first
    score read takes every call's sums to the host at once (one transfer a step, not one per call), each
    layer's score the same as read alone."""
    from slimfit.scheduler import scores

    gen = torch.Generator().manual_seed(0)
    pieces = [(torch.randn(300, generator=gen), torch.randn(300, generator=gen)) for _ in range(6)]
    together = [BlockSums(kind, torch.float32, host=False) for _ in range(3)]
    for call in range(3):   # three optimizer calls, each adding a piece to every layer
        BlockSums.add_together([(sums, *pieces[2 * call + (i % 2)]) for i, sums in enumerate(together)])
    pending = [batch for sums in together for batch, _ in sums._pending]
    assert len({id(b) for b in pending}) == 3 and all(b._host is None for b in pending)
    first = together[0].value()
    assert all(b._host is not None for b in pending) and not scores._UNREAD   # every call read at once
    alone = []
    for i in range(3):
        sums = BlockSums(kind, torch.float32, host=False)
        for call in range(3):
            BlockSums.add_together([(sums, *pieces[2 * call + (i % 2)])])
            sums.value()   # read one call at a time
        alone.append(sums.value())
    assert [first] + [s.value() for s in together[1:]] == alone


@pytest.mark.parametrize("score", ["relative", "robust", "absolute"])
def test_held_moments_scored_inside_the_op_match_the_copies(score, monkeypatch):
    """Every moment held (the default's compress_all, stepped by slimfit::adam_blockwise_): the op summing each
    block's score as it writes the weights (what runs off the CPU; SCORES_IN_OP="always" runs it here) gives the
    scores of the copies' path to float rounding (its own summation order), the same frozen sets and weights, with
    no copy of a weight and fewer ops in the optimizer step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from slimfit.optim import fused_held_step

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    runs = {}
    for mode in ("never", "always"):
        monkeypatch.setattr(fused_held_step, "SCORES_IN_OP", mode)
        copies = []
        monkeypatch.setattr("slimfit.optim.held_step.copies", lambda pieces, _c=copies: _c.append(1) or
                            [t.clone() for t in pieces])
        Count.n = 0
        with Count():
            runs[mode] = _run(BLOCK_NUMEL, score=score, frozen_state="compress_all")
        runs[mode] += (len(copies), Count.n)
    (never, _, _, m1, copied, ops_never), (always, snaps, _, m2, none, ops_always) = runs["never"], runs["always"]
    assert copied > 0 and none == 0 and all(n == 0 for n in snaps)
    for (sa, fa), (sb, fb) in zip(never, always):
        torch.testing.assert_close(sb, sa, rtol=2e-5, atol=0)
        assert fa == fb
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))
    assert ops_always < ops_never
