"""SchedulerConfig.step_chunk_numel="auto" (the default): 2**20 elements a call on the CPU; on another device the
optimizer's parameters' numel / 256, a power of two within [2**20, 2**24] (fewer calls where each costs kernel
launches); an int or None as given; the planner predicts a CUDA step with the chunk a GPU run would take."""
import pytest
import torch

from slimfit._optimizer_state import (
    DEFAULT_STEP_CHUNK_NUMEL,
    MAX_STEP_CHUNK_NUMEL,
    auto_step_chunk_numel,
    resolve_step_chunk_numel,
)
from slimfit.scheduler import ILSScheduler, SchedulerConfig


@pytest.mark.parametrize("device,numel,want", [
    ("cpu", 8 * 10**9, 2**20),          # the CPU launches nothing: the smallest temporaries
    ("cuda", 10**6, 2**20),             # small models: the floor
    ("cuda", 110 * 10**6, 2**20),       # BERT-base: 430k -> the floor
    ("cuda", 494 * 10**6, 2**21),       # Qwen2.5-0.5B: 1.93M -> 2**21
    ("cuda", 1236 * 10**6, 2**23),      # Llama-3.2-1B: 4.8M -> 2**23
    ("cuda", 8 * 10**9, 2**24),         # Llama-3.1-8B: 31M -> the ceiling
    ("meta", 8 * 10**9, 2**24),         # any device but the CPU
])
def test_the_rule(device, numel, want):
    got = auto_step_chunk_numel(device, numel)
    assert got == want and DEFAULT_STEP_CHUNK_NUMEL <= got <= MAX_STEP_CHUNK_NUMEL
    assert got & (got - 1) == 0
    if device != "cpu":   # temporaries about 1/256 of the parameters or less, once above the floor
        assert got == DEFAULT_STEP_CHUNK_NUMEL or got < 2 * numel / 256


def test_resolve_keeps_an_int_or_none_and_resolves_auto_by_the_parameters():
    params = [torch.zeros(10, device="meta"), torch.zeros(600 * 10**6 // 1000, 1000, device="meta")]
    assert resolve_step_chunk_numel("auto", params) == 2**22
    assert resolve_step_chunk_numel("auto", [torch.zeros(600 * 10**6 // 1000, 1, device="cpu")]) == 2**20
    assert resolve_step_chunk_numel(12345, params) == 12345 and resolve_step_chunk_numel(None, params) is None


def test_the_default_is_auto_and_a_cpu_scheduler_steps_2_20_a_call():
    assert SchedulerConfig().step_chunk_numel == "auto"
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt)
    assert sched.chunked_step is not None and sched.chunked_step.chunk_numel == 2**20
    sched.close()


@pytest.mark.parametrize("bad", ["Auto", "", 0, -1, 2.5, True])
def test_bad_values_are_refused_with_the_choices(bad):
    with pytest.raises((ValueError, TypeError), match="step_chunk_numel"):
        SchedulerConfig(step_chunk_numel=bad)


def test_a_cuda_plan_steps_in_the_chunk_a_gpu_run_takes(monkeypatch):
    """The planner's fake run of a CUDA step holds its tensors on the CPU; it still steps in the chunk "auto"
    gives a GPU, and a CPU plan in the CPU's (here with the floor at 2**10 and a share of 1, so that a tiny
    model's GPU chunk, the power of two at or above its parameters' numel, is above the floor)."""
    from slimfit import _optimizer_state
    from slimfit.optim import attach
    from slimfit.plan import StepSpec, predict

    seen = []
    original = attach.attach_chunked_step

    def recording(optimizer, chunk_numel, *args, **kwargs):
        seen.append(chunk_numel)
        return original(optimizer, chunk_numel, *args, **kwargs)

    monkeypatch.setattr(attach, "attach_chunked_step", recording)
    monkeypatch.setattr(_optimizer_state, "STEP_CHUNK_SHARE", 1)
    monkeypatch.setattr(_optimizer_state, "DEFAULT_STEP_CHUNK_NUMEL", 2**10)
    spec = StepSpec("bert-tiny", batch=2, seq=32, preset="paper", rate=0.5)
    predict(spec.replace(device="cuda"))
    assert len(set(seen)) == 1
    cuda = seen[0]
    assert cuda > 2**10 and cuda & (cuda - 1) == 0
    seen.clear()
    predict(spec)
    assert set(seen) == {2**10}
