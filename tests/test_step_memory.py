"""slimfit/step_memory.py: the total peak of one training step, checked against allocations known to the byte,
against slimfit.memory's saved bytes, and against the CPU allocator's own record (PyTorch's profiler)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from slimfit import memory
from slimfit.step_memory import PARTS, StepMemory, measure_step, report

MiB = 2 ** 20


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tests/conftest.py's one_thread) for every test here."""


def _nbytes(*tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _state_bytes(opt) -> int:
    return sum(_nbytes(t) for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))


def _sums(run: StepMemory) -> bool:
    return sum(run.parts().values()) == run.total


def test_a_known_64_mib_temporary_is_counted_to_the_byte():
    torch.manual_seed(0)
    lin = nn.Linear(256, 256, bias=False)
    x = torch.randn(8, 256)

    def forward():
        big = torch.ones(16 * MiB)  # 64 MiB of fp32, freed when forward returns
        y = lin(x)
        return y.sum() + big[0]

    run = measure_step(lin, forward)
    assert run.resident == _nbytes(lin.weight, x)  # x: read by the step, alive before it
    assert run.found_resident == _nbytes(x)
    assert run.total - run.resident >= 64 * MiB
    expected = _nbytes(lin.weight, x) + 64 * MiB + 8 * 256 * 4  # + y; then a few scalars
    assert 0 <= run.total - expected <= 64
    assert run.peak_phase == "forward" and run.transient >= 64 * MiB and _sums(run)
    assert run.end == run.resident  # the gradient was set to None by zero_grad


def test_linear_with_adamw_weights_gradients_moments_exact_and_lazy_state_counted():
    torch.manual_seed(0)
    lin = nn.Linear(1024, 512)
    weights = (1024 * 512 + 512) * 4
    x = torch.randn(4, 1024)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-3)

    def loss(y):
        return y.square().mean()

    first = measure_step(lin, x, opt, loss_fn=loss)
    state = _state_bytes(opt)
    assert state == 2 * weights + 2 * 4  # exp_avg + exp_avg_sq per parameter, and two fp32 step counters
    assert first.resident == weights + _nbytes(x)  # no state yet: AdamW creates it in its first step
    assert first.peak_phase == "optimizer"
    assert (first.weights, first.gradients, first.optimizer_state) == (weights, weights, state)
    assert first.saved == _nbytes(x)  # the batch, saved by the linear for its weight gradient
    assert first.transient > 0 and _sums(first)
    assert first.end == weights + state + _nbytes(x)  # gradients set to None, state kept

    second = measure_step(lin, x, opt, loss_fn=loss)
    assert second.resident == first.end
    assert (second.weights, second.gradients, second.optimizer_state) == (weights, weights, state)
    assert second.total == first.total and _sums(second)
    assert set(second.phase_peaks) == {"entry", "forward", "backward", "optimizer", "zero_grad"}
    assert second.phase_peaks["optimizer"] == second.total


def test_gradients_freed_at_the_start_of_a_step_are_not_counted_twice():
    """A step that zeroes last step's gradients first frees storages older than itself: their bytes leave
    the count when they are freed (PyTorch's profiler would keep them)."""
    torch.manual_seed(0)
    lin = nn.Linear(512, 512)
    x = torch.randn(4, 512)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)

    def forward():
        opt.zero_grad(set_to_none=True)
        return lin(x).sum()

    clean = measure_step(lin, forward, opt)
    lin(x).sum().backward()  # gradients alive at the next step's entry
    stale = measure_step(lin, forward, opt)
    assert stale.resident == clean.resident + _nbytes(lin.weight, lin.bias)
    assert stale.total == clean.total and stale.end == clean.end


def test_a_batch_read_through_a_closure_is_resident_like_a_batch_given():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 8))
    x = torch.randn(32, 128)
    given = measure_step(model, x, loss_fn=lambda y: y.sum())
    closure = measure_step(model, lambda: model(x).sum())
    assert given.found_resident == 0 and closure.found_resident == _nbytes(x)
    assert (closure.total, closure.resident, closure.parts()) == (given.total, given.resident, given.parts())


def test_tensors_made_from_data_and_storages_resized_in_place_are_allocations():
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    x = torch.randn(2, 64)

    def forward():
        fresh = torch.tensor([1.0] * (MiB // 4))  # 1 MiB from Python data (aten::lift_fresh)
        buf = torch.empty(10)
        buf.resize_(2 * MiB // 4)  # 40 bytes grow to 2 MiB in place
        return lin(x).sum() + fresh.sum() + buf.zero_().sum()

    run = measure_step(lin, forward)
    assert run.found_resident == _nbytes(x)  # the new tensors are not mistaken for resident ones
    assert run.total - run.resident >= 3 * MiB
    assert run.end == run.resident  # the resized storage's old and new sizes both left the count


class _Keep(torch.autograd.Function):
    """Saves a 16 MiB buffer for backward; passes the gradient through."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(torch.zeros(4 * MiB))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return _Keep.apply(self.lin(x))


def test_saved_part_is_what_slimfit_memory_counts():
    torch.manual_seed(0)
    model, x = _Model(), torch.randn(16, 64)
    run = measure_step(model, x, loss_fn=lambda y: y.sum())
    saved = memory.measure(model, x, loss_fn=lambda y: y.sum())
    assert saved.total == 16 * MiB + _nbytes(x)
    assert run.saved == saved.total and _sums(run)


def test_report_and_parts():
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    opt = torch.optim.AdamW(lin.parameters())
    plain = measure_step(lin, torch.randn(4, 64), opt, loss_fn=lambda y: y.sum(), name="plain")
    run = measure_step(lin, torch.randn(4, 64), opt, loss_fn=lambda y: y.sum(), name="second")
    assert list(run.parts()) == list(PARTS) and run.over_resident == run.total - run.resident
    text = report(run, plain)
    for label in ("total step peak", "weights", "gradients", "optimizer state", "saved activations", "transient",
                  "resident at entry", "peak in", "plain", "second"):
        assert label in text
    assert "tensor storages, sampled after every op" in str(run)


def test_no_loss_is_a_clear_error_and_meta_is_refused():
    lin = nn.Linear(4, 4)
    with pytest.raises(TypeError, match="no loss"):
        measure_step(lin, lambda: {"logits": lin(torch.randn(2, 4))})
    with pytest.raises(ValueError, match="meta"):
        measure_step(nn.Linear(4, 4, device="meta"), torch.randn(2, 4))


def _profiler_peak(step) -> int:
    """The CPU allocator's highest in-use bytes over step(), above its entry: the running sum of the
    allocation and free events PyTorch's profiler records (every block, inside ops too). Exact for a step
    that frees nothing allocated before it."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = []

    def walk(e):
        if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == "cpu":
            events.append((e.start_time_ns, e.typed[1].alloc_size))
        for child in e.children:
            walk(child)

    for e in prof.profiler.kineto_results.experimental_event_tree():
        walk(e)
    live = peak = 0
    for _, nbytes in sorted(events):
        live += nbytes
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("preset", [None, "paper"])
def test_same_peak_as_the_cpu_allocator_on_a_bert_step(preset):
    """A whole BERT step (AdamW state resident): the storages sampled after every op peak where the allocator
    itself peaks, within a few scalars that ops make and drop inside themselves."""
    pytest.importorskip("transformers")
    import slimfit
    from slimfit import architectures as archs

    model = archs.build("bert-tiny", seed=0)
    inputs = archs.make_inputs(model, archs.TEXT_CLS, batch=4, seq_len=32)
    if preset is not None:
        slimfit.patch(model, slimfit.SlimFitConfig.preset(preset))
        archs.set_frozen(model, [n for n, p in model.named_parameters() if p.dim() == 2 and "layer.0." in n])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)

    def step():
        model(**inputs).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # AdamW state created: nothing the next steps free predates them but the last step's leftovers
    run = measure_step(model, inputs, opt)
    assert _sums(run) and run.found_resident == 0
    assert 0 <= _profiler_peak(step) - (run.total - run.resident) <= 64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_total_is_the_allocator_peak():
    lin = nn.Linear(256, 256, device="cuda")
    x = torch.randn(8, 256, device="cuda")

    def forward():
        big = torch.ones(16 * MiB, device="cuda")
        return lin(x).sum() + big[0]

    run = measure_step(lin, forward, torch.optim.AdamW(lin.parameters()))
    assert "cuda allocator" in run.method
    assert run.total - run.resident >= 64 * MiB and _sums(run)
    assert run.tracked_total <= run.total
