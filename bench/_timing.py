"""Timing helpers shared by the scripts in bench/: the median of many runs (the machine and
versions for result headers are in bench/_results.py).

    t = bench(fn, torch.device("cuda"))      # Timing(ms=median, reps=..., method=...)
    train, sched = bench_phases([train_step, scheduler.step], "cpu", warmup=1, reps=3)   # interleaved

CUDA: `triton.testing.do_bench` (median; it flushes the L2 cache before every run) when
triton is importable, else CUDA events around each run, also with an L2 flush.
CPU: `time.perf_counter` around each run after warm-up, repeated until both a minimum
count and a minimum total time are reached; no cache flush (sizes above the last-level
cache make that moot). `Settings(cpu_clock="process")` times with `time.process_time`
instead: the CPU time of the whole process, which a busy shared machine does not inflate
(a run that is descheduled halfway does not count the wait) but which sums all threads,
so it means "time" only with torch.set_num_threads(1).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class Timing:
    ms: float       # median of `reps` runs, milliseconds
    reps: int       # runs that the median is taken over (do_bench: as it chose)
    method: str     # "do_bench", "cuda-events", "perf_counter" or "process_time"
    wall_ms: float | None = None     # CPU runs: the median by both clocks, whichever `ms` is
    process_ms: float | None = None


@dataclass(frozen=True)
class Settings:
    """How long to measure. `quick()` is for smoke tests, not for numbers."""
    cpu_warmup: int = 1          # calls before timing (0 when the caller already warmed up)
    cpu_min_reps: int = 5
    cpu_min_time_s: float = 0.5  # keep repeating until this much time was measured...
    cpu_max_reps: int = 200      # ...but never more runs than this,
    cpu_max_time_s: float = 5.0  # and slow calls stop after this much time once they
    cpu_slow_min_reps: int = 3   # have this many runs (a 2 s reference op: 3 runs, not 5)
    cpu_clock: str = "wall"      # "wall" (time.perf_counter) or "process" (time.process_time)
    cuda_warmup_ms: float = 25.0  # do_bench's `warmup` and `rep` (milliseconds of runs)
    cuda_rep_ms: float = 100.0

    @classmethod
    def quick(cls) -> "Settings":
        return cls(cpu_warmup=1, cpu_min_reps=2, cpu_min_time_s=0.0, cpu_max_reps=3,
                   cpu_max_time_s=0.5, cpu_slow_min_reps=2, cuda_warmup_ms=2.0, cuda_rep_ms=10.0)

    @classmethod
    def fixed(cls, reps: int, warmup: int = 0) -> "Settings":
        """Exactly `reps` timed CPU runs after `warmup` calls, however long they take (a script whose
        run count is an option of its own)."""
        return cls(cpu_warmup=warmup, cpu_min_reps=reps, cpu_min_time_s=0.0, cpu_max_reps=reps,
                   cpu_slow_min_reps=reps)


DEFAULT = Settings()

_L2_FLUSH_BYTES = 256 << 20  # larger than any current GPU's L2


def _have_triton() -> bool:
    try:
        import triton.testing  # noqa: F401
    except Exception:
        return False
    return True


def bench(fn: Callable[[], object], device, settings: Settings = DEFAULT,
          use_triton: bool | None = None) -> Timing:
    """Median wall time of fn() on `device` (a torch.device or str)."""
    device = torch.device(device)
    if device.type == "cuda":
        if use_triton is None:
            use_triton = _have_triton()
        if use_triton:
            return _bench_do_bench(fn, settings)
        return _bench_cuda_events(fn, device, settings)
    if device.type == "cpu":
        return _bench_cpu(fn, settings)
    raise ValueError(f"bench: unsupported device {device}")


def _bench_do_bench(fn, settings: Settings) -> Timing:
    import triton.testing

    kwargs = dict(warmup=settings.cuda_warmup_ms, rep=settings.cuda_rep_ms)
    try:
        ms = triton.testing.do_bench(fn, return_mode="median", **kwargs)
    except TypeError:  # a triton without return_mode
        ms = triton.testing.do_bench(fn, quantiles=[0.5], **kwargs)
        if isinstance(ms, (list, tuple)):
            ms = ms[0]
    return Timing(float(ms), 0, "do_bench")


def _bench_cuda_events(fn, device, settings: Settings) -> Timing:
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    fn()
    torch.cuda.synchronize(device)
    # Estimate one run to turn the millisecond budgets into counts, as do_bench does.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    est = max(start.elapsed_time(end) / 3, 1e-3)
    n_warm = max(1, int(settings.cuda_warmup_ms / est))
    n_rep = max(5, int(settings.cuda_rep_ms / est))
    for _ in range(n_warm):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize(device)
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return Timing(statistics.median(times), n_rep, "cuda-events")


def bench_phases(fns: Sequence[Callable[[], object]], device, warmup: int, reps: int) -> list[Timing]:
    """The median wall time of each of `fns`, called in turn `warmup + reps` times (the first `warmup`
    rounds not timed). Each phase is timed over the same interleaved rounds, so a phase that changes what
    the next one costs (a scheduler's step freezing layers of the training step) is timed as a loop runs
    it. time.perf_counter around each call, the device synchronized before and after it."""
    device = torch.device(device)
    times: list[list[float]] = [[] for _ in fns]
    for round_ in range(warmup + reps):
        for fn, kept in zip(fns, times):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            if round_ >= warmup:
                kept.append(time.perf_counter() - start)
    return [Timing(statistics.median(t) * 1e3, reps, "perf_counter", wall_ms=statistics.median(t) * 1e3)
            for t in times]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CPU_CLOCKS = {"wall": (time.perf_counter, "perf_counter"), "process": (time.process_time, "process_time")}


def _bench_cpu(fn, settings: Settings) -> Timing:
    """Runs timed by both clocks; the settings' clock decides `ms` and when to stop."""
    _, method = CPU_CLOCKS[settings.cpu_clock]
    for _ in range(settings.cpu_warmup):
        fn()
    walls: list[float] = []
    cpus: list[float] = []
    total = 0.0
    while len(walls) < settings.cpu_max_reps and (
        len(walls) < settings.cpu_min_reps or total < settings.cpu_min_time_s
    ):
        if len(walls) >= settings.cpu_slow_min_reps and total >= settings.cpu_max_time_s:
            break
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        total += walls[-1] if settings.cpu_clock == "wall" else cpus[-1]
    wall_ms, process_ms = statistics.median(walls) * 1e3, statistics.median(cpus) * 1e3
    return Timing(wall_ms if settings.cpu_clock == "wall" else process_ms, len(walls), method, wall_ms, process_ms)
