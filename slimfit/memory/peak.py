"""The total peak memory of one whole training step, and what it is made of at the peak.

    from slimfit.memory import measure_step, step_report
    run = measure_step(model, batch, optimizer)       # forward, backward, optimizer.step(), zero_grad
    run.total, run.resident                           # the step's peak; what was live at its entry
    run.parts()                                       # weights, gradients, optimizer state, saved, transient
    print(step_report(run, baseline=plain_run))       # this module's report()

Whether fine-tuning fits is decided by this peak, not by the bytes autograd saves for backward
(slimfit/memory/saved.py counts those, one part of the peak). The parts are taken at the moment of the peak
and sum to it:
  weights          parameters and buffers of the model (and of the optimizer's parameter groups);
  gradients        storages that were a parameter's `.grad`;
  optimizer_state  tensors of `optimizer.state` (AdamW's moments, created lazily by the first step);
  saved            storages autograd saved for backward (saved-tensor hooks), the batch included
                   when the first layer saves it;
  transient        the rest: the batch, outputs and temporaries of forward and backward, the
                   optimizer's temporaries (and, on CUDA, the allocator's rounding and workspaces).
A storage has one part over its life, the first of the list above it ever belongs to.

How the peak is measured:
  CUDA  the caching allocator's counters, exact (workspaces included): reset_peak_memory_stats at entry,
        resident = memory_allocated at entry, total = max_memory_allocated after the step. The parts
        come from the storage tracker below at its own peak; transient is the rest of the total.
  CPU   torch keeps no statistics of its CPU allocator, so every tensor storage the step touches is
        tracked: a TorchDispatchMode sees every op the step runs (forward, backward, the optimizer)
        with its inputs and outputs. An output storage not seen before is an allocation (its bytes
        are added); a weakref callback on the storage's Python object, which torch keeps alive as
        long as the storage, fires when it is freed (its bytes are taken off). The live total is
        sampled after every op. Storages alive before the step (weights, buffers, gradients,
        optimizer state, the batch, and any other tensor the step reads) are resident from the
        start. Exact for tensor storages at op boundaries; not seen: a buffer an op allocates and
        frees inside itself (C++ kernel workspaces), and memory that is no tensor storage (Python
        objects, autograd graph nodes, oneDNN caches), which no accelerator counts either.
  Why not the others: glibc's mallinfo2 counts every malloc of the process (Python objects, graph
  nodes, arena slack) as well as the tensors, and only with glibc; PyTorch's profiler with
  profile_memory reports the free of a block only when the block was allocated while it ran, so a
  step that frees tensors made before it (last step's gradients, zeroed at the start) is overstated.

The sampling costs a Python call per op: time the step separately, without it.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from . import storage_resizes
from .loss import training_loss
from .units import format_bytes

__all__ = ["StepMemory", "measure_step", "report", "PARTS"]

PARTS = ("weights", "gradients", "optimizer_state", "saved", "transient")
# Role precedence: a storage keeps the strongest role it ever had (lower index wins).
WEIGHTS, OPTIMIZER, GRADIENTS, SAVED, TRANSIENT = range(5)
_ROLE_PART = {WEIGHTS: "weights", OPTIMIZER: "optimizer_state", GRADIENTS: "gradients", SAVED: "saved",
              TRANSIENT: "transient"}
_FRESH_INPUT_OPS = {"aten::lift_fresh", "aten::lift_fresh_copy"}  # torch.tensor(data): the input is new
# Frames between an op's caller and a dispatch mode: torch's wrappers, and the modes of slimfit.memory
_DISPATCH_FRAMES = ("/torch/_dynamo/", "/torch/_compile.py", "/torch/utils/_python_dispatch.py",
                    "/slimfit/memory/peak.py", "/slimfit/memory/plan/fake.py", "/torch/_ops.py")


def _from_autograd_engine() -> bool:
    """Whether the op being dispatched was called by autograd's engine itself (no Python frame of a backward
    function in between): the engine's own sums of two gradients of one tensor are such ops."""
    frame = sys._getframe(2)
    while frame is not None and any(part in frame.f_code.co_filename for part in _DISPATCH_FRAMES):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name == "_engine_run_backward"


@dataclasses.dataclass
class StepMemory:
    """Peak bytes of one training step, the parts at the peak, and bytes live at entry and exit."""

    total: int = 0               # peak bytes of the step, what was resident at entry included
    resident: int = 0            # bytes live at the step's entry
    end: int = 0                 # bytes live when the step returned (state kept for the next step)
    weights: int = 0             # the parts at the peak (they sum to total)
    gradients: int = 0
    optimizer_state: int = 0
    saved: int = 0
    transient: int = 0
    peak_phase: str = ""         # entry, forward, backward, optimizer, zero_grad or after_step
    phase_peaks: dict[str, int] = dataclasses.field(default_factory=dict)
    ops: int = 0                 # ops dispatched (and sampled) in the step
    found_resident: int = 0      # bytes from before the step first met as an op's input (not given at entry)
    tracked_total: int = 0       # the storage tracker's own peak (== total on the CPU)
    device: str = "cpu"
    method: str = ""             # "tensor storages, sampled after every op" or "cuda allocator"
    name: str = ""

    def parts(self) -> dict[str, int]:
        """The parts of the peak, in the order of PARTS."""
        return {p: getattr(self, p) for p in PARTS}

    @property
    def over_resident(self) -> int:
        """How far the step rises above what it found resident."""
        return self.total - self.resident

    def __str__(self) -> str:
        return report(self)


class _Record:
    """One tracked storage: its bytes, the samples it is live in [born, died) and its role."""

    __slots__ = ("nbytes", "born", "died", "role")

    def __init__(self, nbytes: int, born: int, role: int):
        self.nbytes, self.born, self.died, self.role = nbytes, born, None, role


def _tensors(obj, depth: int = 0) -> Iterable[torch.Tensor]:
    """Tensors inside an op's arguments or outputs (nested tuples, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)


def _same_device(device: torch.device) -> torch.device:
    """`cuda` -> `cuda:<current>`, so that tensors' devices compare equal to it."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class _Tracker(TorchDispatchMode):
    """Live bytes of the tensor storages of one device, sampled after every dispatched op."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = _same_device(device)
        self.live: dict[int, _Record] = {}     # StorageImpl address -> record
        self.refs: dict[int, weakref.ref] = {}
        self.dead: list[_Record] = []
        self.now = 0                           # bytes live now
        self.samples: list[int] = []           # self.now after each op
        self.phases: list[tuple[str, int]] = []  # (phase, index of its first sample)
        self.backfill: list[tuple[int, int]] = []  # (bytes, sample index): resident storages found late
        self.entry = 0                         # bytes registered as resident before the step
        self.engine_sum = None                 # (keys of the summands, the sum's record, its sample index)
        self.shrunk: dict[int, int] = {}        # StorageImpl address -> role: resized to 0 bytes in place
        self.after_collective: int | None = None  # the sample of the c10d collective just dispatched, else None

    def _storage(self, t: torch.Tensor):
        if t.device != self.device:
            return None
        # a DTensor (FSDP2's sharded parameters, their gradients and Adam state) holds this device's bytes in its
        # local piece; its own storage is a stand-in of the global size that owns nothing
        local = getattr(t, "_local_tensor", None)
        if isinstance(local, torch.Tensor):
            t = local
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, wrapper subclasses
            return None
        return storage if storage.nbytes() > 0 else None

    def add(self, t: torch.Tensor, role: int, born: int) -> _Record | None:
        """Track t's storage (no-op when tracked already: the role is merged); its record."""
        storage = self._storage(t)
        if storage is None:
            return None
        key = storage._cdata
        rec = self.live.get(key)
        if rec is not None:
            rec.role = min(rec.role, role)
            if rec.nbytes != storage.nbytes():  # resized in place (out= ops): a free and an allocation
                self._close(rec)
                self._open(key, _Record(storage.nbytes(), len(self.samples), rec.role))
            return rec
        rec = _Record(storage.nbytes(), born, role)
        self._open(key, rec)
        self.refs[key] = weakref.ref(storage, functools.partial(self._freed, key))
        return rec

    def _open(self, key: int, rec: _Record) -> None:
        self.live[key] = rec
        self.now += rec.nbytes

    def _close(self, rec: _Record) -> None:
        rec.died = len(self.samples)
        self.now -= rec.nbytes
        self.dead.append(rec)

    def _freed(self, key: int, _ref) -> None:
        self.refs.pop(key, None)
        self.shrunk.pop(key, None)
        rec = self.live.pop(key, None)
        if rec is not None:
            self._close(rec)

    def storage_resized(self, storage) -> None:
        """A storage resized in place outside any op (storage_resizes.py): its bytes end and, when it has any,
        start again now with the role it had; one shrunk to nothing counts again when it grows back, one grown
        from nothing that was never tracked is a transient allocated now."""
        key = storage._cdata
        nbytes = storage.nbytes()
        rec = self.live.get(key)
        if rec is not None:
            if rec.nbytes == nbytes:
                return
            del self.live[key]
            self._close(rec)
            role = rec.role
        else:
            role = self.shrunk.pop(key, None)
            if role is None:   # grown from nothing here (FSDP2's gather buffers): allocated now
                if storage.device != self.device:
                    return
                role = TRANSIENT
        if nbytes > 0:
            self._open(key, _Record(nbytes, len(self.samples), role))
            if key not in self.refs:
                self.refs[key] = weakref.ref(storage, functools.partial(self._freed, key))
        else:
            self.shrunk[key] = role

    def mark(self, t: torch.Tensor | None, role: int) -> None:
        """Give t's storage a role (the strongest it ever had is kept)."""
        if isinstance(t, torch.Tensor):
            storage = self._storage(t)
            rec = None if storage is None else self.live.get(storage._cdata)
            if rec is not None:
                rec.role = min(rec.role, role)

    def found(self, t: torch.Tensor, role: int = TRANSIENT) -> None:
        """t met as an op's input (or saved for backward): a storage not tracked yet was alive before the step,
        unless it is met right after a collective, whose kernel made it (below)."""
        storage = self._storage(t)
        if storage is None or storage._cdata in self.live:
            return
        if self.after_collective is not None:
            # A process group's own buffer: gloo's reduce-scatter clones its whole input inside the c10d op (no
            # op this mode sees) and splits that clone into the output after it. Born at the collective, not
            # alive since the step's entry: FSDP2's per-layer reduce-scatter inputs would add up to a full copy
            # of the model's weights at the forward's peak (bench/results/sharded_cpu.md).
            rec = self.add(t, role, born=self.after_collective)
            if self.after_collective < len(self.samples):   # that sample was taken before the clone was seen
                self.samples[self.after_collective] += rec.nbytes
            return
        rec = self.add(t, role, born=-1)
        self.backfill.append((rec.nbytes, len(self.samples)))

    def phase(self, name: str) -> None:
        self.phases.append((name, len(self.samples)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.settle_engine_sum()
        collective = func.namespace == "c10d"
        if collective:   # a collective's inputs are the caller's (a storage met first here was alive before)
            self.after_collective = None
        if func._schema.name not in _FRESH_INPUT_OPS:
            for t in _tensors((args, kwargs)):
                self.found(t)
        # the ops a collective's kernel runs right after it (gloo: split and copy_ of its buffer) follow it here
        self.after_collective = len(self.samples) if collective else None
        out = func(*args, **kwargs)
        rec = None
        for t in _tensors(out):
            rec = self.add(t, TRANSIENT, born=len(self.samples))
        self.samples.append(self.now)
        if func is torch.ops.aten.add.Tensor and not kwargs and rec is not None and _from_autograd_engine():
            old = args[0] if len(args) > 1 and all(isinstance(t, torch.Tensor) for t in args[:2]) else None
            # a run without the tracker adds into the gradient already there (the first summand) when it may
            # take that tensor over: its own storage (not a view: an HF Linear head's weight gradient is one,
            # and that sum is made out of place, a third tensor), not sparse
            key = None if old is None or old._base is not None or old.is_sparse else self._storage(old)
            if key is not None and self._storage(args[1]) is not None:
                self.engine_sum = ([key._cdata], rec, len(self.samples) - 1)
        return out

    def settle_engine_sum(self) -> None:
        """Autograd sums two gradients of one tensor in place into the first (the one already in its buffer)
        when it holds the last reference to it and its storage, unless a dispatch mode is active (torch's
        InputBuffer): under this tracker it makes a third tensor. When that summand is freed right after the
        sum, the sum is counted from the next sample on, as that summand's storage continuing (tied embeddings,
        residuals); a first summand that is a view keeps its base's storage shared, and the sum stays a third
        tensor, as in a run without the tracker (measured by peak RSS: an HF-style tied bf16 head of
        128256 x 2048 rose three head sizes in backward, an untied one two)."""
        if self.engine_sum is None:
            return
        keys, rec, sample = self.engine_sum
        self.engine_sum = None
        if any(key not in self.live for key in keys) and rec.born == sample:
            self.samples[sample] -= rec.nbytes
            rec.born = sample + 1

    def detach(self) -> None:
        """Stop listening to frees (the step is over): drop the weakrefs and their callbacks."""
        self.refs.clear()

    def series(self) -> list[int]:
        """Live bytes at entry (index 0) and after every op (index k + 1): resident storages met late
        were live from the start, so their bytes are added to the samples before they were met."""
        full = [self.entry] + self.samples
        diff = [0] * (len(full) + 1)
        for nbytes, index in self.backfill:
            diff[0] += nbytes
            diff[index + 1] -= nbytes
        running = 0
        for i in range(len(full)):
            running += diff[i]
            full[i] += running
        return full

    def parts_at(self, sample: int) -> dict[str, int]:
        """Bytes per part of the storages live at `sample` (-1: the entry)."""
        parts = dict.fromkeys(PARTS, 0)
        for rec in list(self.live.values()) + self.dead:
            if rec.born <= sample and (rec.died is None or sample < rec.died):
                parts[_ROLE_PART[rec.role]] += rec.nbytes
        return parts

    def phase_peaks(self, full: list[int]) -> dict[str, int]:
        """The highest sample of each phase (entry: the bytes at entry)."""
        peaks = {"entry": full[0]}
        bounds = self.phases + [("", len(self.samples))]
        for (name, start), (_, stop) in zip(bounds, bounds[1:]):
            if stop > start:
                peaks[name] = max(peaks.get(name, 0), max(full[start + 1:stop + 1]))
        return peaks

    def phase_of(self, sample: int) -> str:
        name = "entry"
        for phase, start in self.phases:
            if start <= sample:
                name = phase
        return name


# ------------------------------------------------------------------ the step
_FIX = ("pass a batch with labels so the model computes its own loss, loss_fn=<output -> scalar loss> (e.g. "
        "loss_fn=lambda out: out.logits.sum()), or a callable that runs the forward and returns the loss")


def _forward_of(model: nn.Module, batch_or_callable) -> Callable[[], Any]:
    if callable(batch_or_callable) and not isinstance(batch_or_callable, (torch.Tensor, nn.Module)):
        return batch_or_callable
    batch = batch_or_callable
    if isinstance(batch, dict):
        return lambda: model(**batch)
    if isinstance(batch, (tuple, list)):
        return lambda: model(*batch)
    return lambda: model(batch)


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    state = getattr(optimizer, "state", None) or {}
    return [t for per_param in state.values() for t in _tensors(per_param)]


def _parameters(model: nn.Module, optimizer) -> list[torch.Tensor]:
    params = {id(p): p for p in model.parameters()}
    for group in getattr(optimizer, "param_groups", ()):
        params.update((id(p), p) for p in group["params"])
    return list(params.values())


def _register_resident(tracker: _Tracker, model, params, optimizer, batch_or_callable) -> None:
    """Everything known to be live at entry: weights and buffers, gradients, optimizer state, the batch."""
    for t in list(params) + list(model.buffers()):
        tracker.add(t, WEIGHTS, born=-1)
    for p in params:
        if p.grad is not None:
            tracker.add(p.grad, GRADIENTS, born=-1)
    for t in _optimizer_tensors(optimizer):
        tracker.add(t, OPTIMIZER, born=-1)
    if not callable(batch_or_callable):
        for t in _tensors(batch_or_callable):
            tracker.add(t, TRANSIENT, born=-1)
    tracker.entry = tracker.now


def _run_step(tracker: _Tracker, forward, loss_fn, model, optimizer, params, after_step, set_to_none) -> None:
    """forward, backward, optimizer.step(), zero_grad, after_step(), each a phase of the tracker."""
    tracker.phase("forward")
    loss = training_loss(forward(), loss_fn, who="slimfit.memory.measure_step", fix=_FIX)
    tracker.phase("backward")
    loss.backward()
    del loss
    for p in params:
        tracker.mark(p.grad, GRADIENTS)
    if optimizer is not None:
        tracker.phase("optimizer")
        optimizer.step()
        for t in _optimizer_tensors(optimizer):
            tracker.mark(t, OPTIMIZER)
    tracker.phase("zero_grad")
    (optimizer if optimizer is not None else model).zero_grad(set_to_none=set_to_none)
    if after_step is not None:
        tracker.phase("after_step")
        after_step()
    for t in _optimizer_tensors(optimizer):
        tracker.mark(t, OPTIMIZER)


def _device_of(model: nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def measure_step(
    model: nn.Module,
    batch_or_callable,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    loss_fn: Callable | None = None,
    after_step: Callable[[], Any] | None = None,
    set_to_none: bool = True,
    name: str = "",
) -> StepMemory:
    """Run one whole training step and return its total peak memory with the parts at the peak.

    The step: forward (`model(**batch)` for a dict, `model(*batch)` for a tuple or list, `model(batch)`
    otherwise, or `batch_or_callable()` when it is a callable: that callable runs the forward, with
    autocast or extra arguments as it likes, and returns the output), the loss (`loss_fn(output)`, else
    `output.loss`, else the output when it is one element: slimfit/memory/loss.py, which refuses any other
    output with NoLossError naming the fix), `loss.backward()`, `optimizer.step()` when an optimizer is
    given, `zero_grad(set_to_none=set_to_none)` of the optimizer (else of the model), then `after_step()`
    (a scheduler's step, say). The output is dropped before backward and the loss after it, as in a
    training loop. The step runs for real: the weights and the optimizer state change as they would.
    Measure a second step to see the steady state (the first creates AdamW's state lazily).
    Memory is that of the model's device; see the module docstring for how it is counted there.
    """
    device = _device_of(model)
    if device.type == "meta":
        raise ValueError("measure_step: the model is on the meta device, where nothing is allocated")
    params = _parameters(model, optimizer)
    tracker = _Tracker(device)
    _register_resident(tracker, model, params, optimizer, batch_or_callable)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        entry = torch.cuda.memory_allocated(device)
    hooks = [p.register_post_accumulate_grad_hook(lambda p: tracker.mark(p.grad, GRADIENTS))
             for p in params if p.requires_grad and p.is_leaf]

    def pack(t: torch.Tensor):
        tracker.found(t, SAVED)  # autograd saves an op's inputs before the op reaches the tracker
        tracker.mark(t, SAVED)
        return t

    try:
        with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                storage_resizes.watch(tracker.storage_resized):
            _run_step(tracker, _forward_of(model, batch_or_callable), loss_fn, model, optimizer, params,
                      after_step, set_to_none)
    finally:
        for h in hooks:
            h.remove()
        tracker.detach()
    result = _result(tracker, name, str(device))
    if cuda:
        torch.cuda.synchronize(device)
        _use_allocator(result, entry, torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device))
    return result


def _result(tracker: _Tracker, name: str, device: str) -> StepMemory:
    tracker.settle_engine_sum()
    full = tracker.series()
    peak = max(range(len(full)), key=full.__getitem__)
    sample = peak - 1
    result = StepMemory(total=full[peak], resident=full[0], end=tracker.now, tracked_total=full[peak],
                        peak_phase=tracker.phase_of(sample) if sample >= 0 else "entry",
                        phase_peaks=tracker.phase_peaks(full), ops=len(tracker.samples),
                        found_resident=sum(n for n, _ in tracker.backfill), device=device,
                        method="tensor storages, sampled after every op", name=name)
    for part, nbytes in tracker.parts_at(sample).items():
        setattr(result, part, nbytes)
    return result


def _use_allocator(result: StepMemory, entry: int, peak: int, end: int) -> None:
    """CUDA: the allocator's exact figures; transient becomes the rest of its peak."""
    result.method = "cuda allocator (max_memory_allocated); parts from tensor storages"
    result.total, result.resident, result.end = peak, entry, end
    known = result.weights + result.gradients + result.optimizer_state + result.saved
    result.transient = max(0, peak - known)


# ------------------------------------------------------------------ reporting
def report(run: StepMemory, baseline: StepMemory | None = None) -> str:
    """A text table of the step's peak and its parts (and a baseline's, with baseline / run)."""
    rows = [("total step peak", "total"), ("  weights", "weights"), ("  gradients", "gradients"),
            ("  optimizer state", "optimizer_state"), ("  saved activations", "saved"),
            ("  transient", "transient"), ("resident at entry", "resident"), ("live at exit", "end")]
    head = ["", run.name or "step"] + ([baseline.name or "baseline", "baseline / step"] if baseline else [])
    body = []
    for label, attr in rows:
        line = [label, format_bytes(getattr(run, attr))]
        if baseline is not None:
            b, r = getattr(baseline, attr), getattr(run, attr)
            line += [format_bytes(b), f"{b / r:.2f}x" if r else ("-" if b == 0 else "inf")]
        body.append(line)
    phase = ["peak in", run.peak_phase] + ([baseline.peak_phase, ""] if baseline else [])
    widths = [max(len(r[i]) for r in [head, phase] + body) for i in range(len(head))]
    lines = ["  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]).rstrip()
             for r in [head] + body + [phase]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + [f"({run.device}: {run.method}; {run.ops} ops)"])
