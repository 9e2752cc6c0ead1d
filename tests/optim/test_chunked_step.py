"""ChunkedStep: torch's Adam/AdamW step a piece at a time. Weights, moments and step counts are those of
torch's own step bit for bit; what it cannot take is left to torch's step; the optimizer step's temporaries
are bounded by the chunk, not by the largest (or every) parameter."""
import pytest
import torch
from _optim_models import build, data, loss_of
from torch import nn

from slimfit.optim import ChunkedStep, attach_frozen_state, step_in_backward
from slimfit.scheduler import ILSScheduler
from slimfit.step_memory import measure_step


class EmbedMLP(nn.Module):
    """An embedding larger than the chunks (split into pieces), then small layers (packed together)."""

    def __init__(self, vocab=3000, d=40):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 3)

    def forward(self, ids):
        return self.head(self.norm(torch.relu(self.fc(self.emb(ids)))).mean(1))


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return EmbedMLP(**kw)


def _train(model, opt, steps=3, lr_sched=None):
    for step in range(steps):
        ids = torch.randint(0, model.emb.num_embeddings, (6, 7), generator=torch.Generator().manual_seed(step))
        model(ids).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if lr_sched is not None:
            lr_sched.step()


def _same_run(a, oa, b, ob) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        sa, sb = oa.state[p], ob.state[q]
        assert sorted(sa) == sorted(sb), name
        for k in sa:
            assert torch.equal(sa[k], sb[k]), (name, k)


OPTIONS = [
    (torch.optim.AdamW, {}),
    (torch.optim.AdamW, {"foreach": True}),
    (torch.optim.AdamW, {"amsgrad": True, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"foreach": True, "amsgrad": True, "maximize": True}),
    (torch.optim.Adam, {}),
    (torch.optim.Adam, {"foreach": True, "weight_decay": 0.05}),
    (torch.optim.AdamW, {"fused": True}),
    (torch.optim.Adam, {"fused": True, "amsgrad": True, "weight_decay": 0.05}),
]


@pytest.mark.parametrize("cls,kwargs", OPTIONS, ids=lambda v: getattr(v, "__name__", None) or str(v))
@pytest.mark.parametrize("chunk", [1000, 1 << 20])
def test_weights_and_state_are_torch_steps_bit_for_bit(cls, kwargs, chunk):
    a, b = _model(), _model()
    oa, ob = cls(a.parameters(), lr=1e-2, **kwargs), cls(b.parameters(), lr=1e-2, **kwargs)
    step = ChunkedStep(ob, chunk_numel=chunk)
    sa = torch.optim.lr_scheduler.LambdaLR(oa, lambda s: 1.0 / (1 + s))
    sb = torch.optim.lr_scheduler.LambdaLR(ob, lambda s: 1.0 / (1 + s))
    _train(a, oa, lr_sched=sa)
    _train(b, ob, lr_sched=sb)
    _same_run(a, oa, b, ob)
    assert step.pieces_stepped == 3 * len(list(b.parameters()))   # every parameter, every step, by the chunks
    assert all(float(ob.state[p]["step"]) == 3 for p in b.parameters())


def test_parameters_without_a_gradient_are_not_touched():
    a, b = _model(), _model()
    for m in (a, b):
        m.fc.weight.requires_grad_(False)
    oa, ob = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    ChunkedStep(ob, chunk_numel=1000)
    _train(a, oa)
    _train(b, ob)
    _same_run(a, oa, b, ob)
    assert b.fc.weight not in ob.state or not ob.state[b.fc.weight]


def test_what_it_cannot_take_is_left_to_torch_step():
    """A differentiable group, a non-contiguous parameter: torch steps them (same result); other optimizers
    and subclasses of AdamW are not hooked at all."""
    a, b = _model(), _model()
    for m in (a, b):
        m.fc.weight = nn.Parameter(m.fc.weight.detach().t().contiguous().t())   # a transposed view: strided
    def groups(m):
        rest = [p for n, p in m.named_parameters() if n != "emb.weight"]
        return [{"params": [m.emb.weight], "differentiable": True}, {"params": rest}]

    oa, ob = torch.optim.AdamW(groups(a), lr=1e-2), torch.optim.AdamW(groups(b), lr=1e-2)
    seen = []

    class Observer:
        def wants(self, p):
            return False

        def left_to_optimizer(self, params):
            seen.append({id(p) for p in params})

    observer = Observer()
    step = ChunkedStep(ob, chunk_numel=1000, observer=observer)
    _train(a, oa)
    _train(b, ob)
    _same_run(a, oa, b, ob)
    assert seen and all(s == {id(b.emb.weight), id(b.fc.weight)} for s in seen)
    assert step.pieces_stepped == 3 * (len(list(b.parameters())) - 2)

    class MyAdamW(torch.optim.AdamW):
        pass

    for opt in (torch.optim.SGD(b.parameters(), lr=0.1), MyAdamW(b.parameters())):
        assert not ChunkedStep(opt).active


def test_the_observer_sees_every_piece_of_the_parameters_it_wants_once_in_order():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pieces = []

    class Observer:
        def wants(self, p):
            return p is model.emb.weight or p is model.head.weight

        def piece(self, p, start, old, new):
            pieces.append((p is model.emb.weight, start, old.numel(), torch.equal(old, new)))

        def left_to_optimizer(self, params):
            raise AssertionError("nothing is left to torch here")

    observer = Observer()
    ChunkedStep(opt, chunk_numel=4096, observer=observer)
    before = model.emb.weight.detach().clone()
    _train(model, opt, steps=1)
    emb = [(s, n) for is_emb, s, n, _ in pieces if is_emb]
    assert emb == [(a, min(4096, model.emb.weight.numel() - a)) for a in range(0, model.emb.weight.numel(), 4096)]
    assert [n for is_emb, _, n, _ in pieces if not is_emb] == [model.head.weight.numel()]
    assert not any(same for *_, same in pieces)                   # old values, then the updated ones
    assert not torch.equal(before, model.emb.weight)


def test_in_backward_each_parameter_optimizer_is_chunked_and_the_loop_is_the_plain_one():
    a, b = _model(), _model()
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    ob = step_in_backward(b, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    step = ChunkedStep(ob, chunk_numel=1000)
    assert len(step.optimizers) == len(list(b.parameters()))
    _train(a, oa)
    _train(b, ob)
    _same_run(a, oa, b, ob)
    assert step.pieces_stepped == 3 * len(list(b.parameters()))


def test_a_frozen_state_attached_after_it_runs_first():
    """FrozenState(between_steps=False) attached by hand after the scheduler's chunked step: the run is the
    one with torch's own step (the held state is back before the chunked step reads it)."""
    def run(chunked):
        model = build(seed=0, depth=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = ILSScheduler(model, freeze_rate=0.5, seed=0, frozen_state=None, update_scale="none", warmup_steps=0,
                             step_chunk_numel=(1 << 15) if chunked else None)   # (a stretch rounds apart)
        sched.attach_optimizer(opt)
        attach_frozen_state(sched, opt, mode="compress")
        for step in range(6):
            loss_of(model, data(seed=step % 2)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        return model, sched

    (a, sa), (b, sb) = run(False), run(True)
    assert sb._chunked_step is not None and sb._chunked_step.pieces_stepped > 0
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert sa.frozen_names() == sb.frozen_names()


def test_the_optimizer_step_temporaries_are_bounded_by_the_chunk():
    """One large embedding: torch's single-tensor AdamW makes two temporaries its size at the step
    (sqrt, then the division); the chunked step makes them the chunk's size."""
    def peak(chunked):
        model = _model(vocab=20000, d=64)            # 1.28 M entries, 4.9 MiB
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _train(model, opt, steps=1)                  # the state exists, as in every later step
        if chunked:
            ChunkedStep(opt, chunk_numel=1 << 16)
        ids = torch.randint(0, 20000, (6, 7), generator=torch.Generator().manual_seed(9))
        return measure_step(model, lambda: model(ids).square().mean(), opt, loss_fn=lambda out: out)

    plain, chunked = peak(False), peak(True)
    emb_bytes = 20000 * 64 * 4
    assert plain.peak_phase == "optimizer"
    assert plain.total - chunked.total >= 2 * emb_bytes - 2 * (1 << 16) * 4 - (1 << 16)
    assert chunked.phase_peaks["optimizer"] - chunked.resident <= emb_bytes + 4 * (1 << 16) * 4 + (1 << 16)
    assert chunked.resident == plain.resident


def test_bad_chunk_sizes_are_refused():
    opt = torch.optim.AdamW(_model().parameters())
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="chunk_numel must be a positive int"):
            ChunkedStep(opt, chunk_numel=bad)


def test_a_grad_scaler_with_a_fused_optimizer_unscales_and_skips_as_torch_s_step():
    """GradScaler hands a fused optimizer its scale and inf flag (optimizer.grad_scale / found_inf); the pieces
    get them as torch's step would: the same weights, and the step with an inf gradient skipped alike."""
    def run(chunked):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        if chunked:
            ChunkedStep(opt, chunk_numel=1000)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        for step in range(4):
            ids = torch.randint(0, 3000, (6, 7), generator=torch.Generator().manual_seed(step))
            loss = model(ids).square().mean()
            if step == 2:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        return model, opt

    (a, oa), (b, ob) = run(False), run(True)
    _same_run(a, oa, b, ob)
    assert all(float(ob.state[p]["step"]) == 3 for p in b.parameters())
