"""`slimfit plan --fit BUDGET`: the fastest configuration whose predicted step peak fits the budget.

Searched, at the batch, sequence, dtype and optimizer given: every preset (none, exact, paper, aggressive)
x freeze rate (0, 0.5, 0.7, 0.9; ILSScheduler) x checkpointing (off, on), and LoRA (rank given, else 8; no
freeze rate: the base is frozen) x preset x checkpointing: 40 configurations; with AdamW, each one with a
freeze rate again with the frozen layers' state held 8-bit (and, on a GPU, offloaded to host memory, and
every layer's state in host memory under the optimizer step in backward, its host traffic added to the
estimated time: cost.host_traffic_seconds): 88 on a CPU, 136 on a GPU. Of configurations of the same
estimated time the one that holds the state in full goes first, then in host memory (lossless), then 8-bit
(lossy: docs/fidelity.md).

Speed first (cheap), memory second (exact), so that few full predictions run:
  1. each configuration's step time is estimated (cost.py: flops, bytes moved, ops) from predictions of the
     model cut to depth 0 and 1 (LoRA: 1 and 2), which cost a fraction of the full one: a step's ops grow
     linearly with depth, so t(L) = t(0) + L * (t(1) - t(0)). A freeze rate f mixes a trained and a frozen
     model (_line): every layer the scheduler would schedule frozen, the tied LM head outside the layers
     too, predicted at depths 0 and 1. The same runs give the
     weights and optimizer state at full depth (linear in depth, exact): a configuration whose resident
     bytes alone exceed the budget is not predicted at all;
  2. in order of estimated time, the full step is predicted (predict.py, exact on the CPU) until one fits.
"""
from __future__ import annotations

import dataclasses
import itertools

from ..models import ModelRef, resolve_model
from .cost import host_traffic_seconds, step_seconds
from .fakerun import Prediction
from .predict import predict
from .spec import StepSpec

__all__ = ["Candidate", "FitResult", "candidates", "fit", "PRESETS", "RATES", "LORA_RANK"]

PRESETS = ("none", "exact", "paper", "aggressive")   # searched; wta_crs (sampled gradients) is a choice of accuracy
RATES = (0.0, 0.5, 0.7, 0.9)
LORA_RANK = 8


@dataclasses.dataclass
class Candidate:
    spec: StepSpec
    est_seconds: float = 0.0       # estimated step time (cost.py)
    resident: int = 0              # weights + optimizer state at full depth (bytes)
    prediction: Prediction | None = None
    status: str = "not predicted"  # fits | too big | resident alone too big | not predicted

    @property
    def total(self) -> int | None:
        """The predicted step peak in bytes, None when the candidate was not predicted."""
        return None if self.prediction is None else self.prediction.total


@dataclasses.dataclass
class FitResult:
    budget: int
    best: Candidate | None
    candidates: list       # every candidate, fastest (estimated) first


def candidates(base: StepSpec, lora_rank: int | None = None) -> list[StepSpec]:
    """The configurations --fit searches, at base's model, batch, shape, dtype and optimizer."""
    # warmup_steps=0: each configuration's frozen set at its rate from the first step, so that the budget holds
    # at every step (a causal LM's default ramp trains every layer first)
    plain = dict(preset="none", rate=0.0, lora=None, checkpointing=False, budget_bytes=None, frozen_state=None,
                 step_in_backward=False, warmup_steps=0)
    base = base.replace(**plain)
    out = [base.replace(preset=p, rate=r, checkpointing=c)
           for p, r, c in itertools.product(PRESETS, RATES, (False, True))]
    out += [base.replace(preset=p, lora=lora_rank or LORA_RANK, checkpointing=c)
            for p, c in itertools.product(PRESETS, (False, True))]
    if base.optimizer == "adamw":
        out += [base.replace(preset=p, rate=r, checkpointing=c, frozen_state=f, step_in_backward=f == "offload_all")
                for f, p, r, c in itertools.product(frozen_states(base.device), PRESETS, RATES[1:], (False, True))]
    return out


def frozen_states(device: str) -> tuple:
    """The frozen-state options worth searching on the device, in the order a tie is broken: offload (the
    frozen layers' moments) and offload_all (every layer's, with the step in backward) are lossless but save only
    on a GPU; compress (the frozen layers' moments 8-bit) and compress_all (every layer's, the scheduler's
    default) cost a little accuracy (docs/fidelity.md)."""
    if device == "cuda":
        return ("offload", "offload_all", "compress", "compress_all")
    return ("compress", "compress_all")


# at equal time: in full, lossless, the frozen layers' state lossy, every layer's state lossy
_PREFERENCE = {None: 0, "offload": 1, "offload_all": 1, "compress": 2, "compress_all": 3}


def _preference(spec: StepSpec) -> int:
    """Among configurations of the same estimated time: state in full, then offloaded, then 8-bit."""
    return _PREFERENCE[spec.frozen_state]


def _depth(ref: ModelRef) -> int:
    """The model's number of layers, from its config (the depth the shallow estimates extrapolate to)."""
    for key in ("num_hidden_layers", "n_layer", "n_layers"):
        if getattr(ref.config, key, None):
            return int(getattr(ref.config, key))
    raise ValueError(f"{ref.name}: the config names no depth (num_hidden_layers)")


def _counts(p: Prediction) -> tuple[float, float, float, int, int, int]:
    """(flops, bytes moved, ops, weights + optimizer state, parameters trained in the step, weights) of a
    prediction."""
    return p.flops, p.bytes_moved, p.ops, p.memory.weights + p.memory.optimizer_state, p.trained, p.memory.weights


def _line(a, b, depth: int, mix: float = 0.0, c=None, a_frozen=None):
    """(1 - mix) * a + mix * a_frozen + depth * ((1 - mix) * (b - a) + mix * (c - a_frozen)), per count: the
    shallow model trained (a) and with what the scheduler schedules frozen (a_frozen), each layer trained (b - a)
    or frozen (c - a_frozen), mixed at the freeze rate."""
    c = b if c is None else c
    a_frozen = a if a_frozen is None else a_frozen
    return [(1 - mix) * x + mix * xf + depth * ((1 - mix) * (y - x) + mix * (z - xf))
            for x, y, z, xf in zip(a, b, c, a_frozen)]


class _Shallow:
    """predict() of the shallow specs the estimates are made of, each spec predicted once: the groups that
    differ only in the frozen state share their trained runs (a third of the shallow predictions)."""

    def __init__(self, ref: ModelRef):
        self.ref, self.done = ref, {}

    def __call__(self, spec: StepSpec, freeze_all: bool = False):
        """The counts (_counts) of the spec's prediction, predicted on the first call."""
        key = (spec, freeze_all)
        if key not in self.done:
            self.done[key] = _counts(predict(spec, ref=self.ref, freeze_all=freeze_all))
        return self.done[key]


def _estimate_group(spec: StepSpec, ref: ModelRef, depth: int, rates,
                    frozen_state: str | None = None, shallow: _Shallow | None = None) -> list[tuple[float, int]]:
    """[(estimated seconds, resident bytes)] of spec at each rate (LoRA: one), from shallow predictions: depths
    0 and 1 (LoRA, or a model that cannot be built without layers: 1 and 2); a frozen layer's state held as
    frozen_state says. shallow: the memo of the shallow predictions (one per search)."""
    device, dtype = spec.device, spec.matmul_dtype
    shallow = shallow or _Shallow(ref)
    low = 1 if spec.lora else 0
    try:
        first = shallow(spec.replace(layers=low))
    except Exception:  # noqa: BLE001 - a model type that needs a layer: start from one
        low = 1
        first = shallow(spec.replace(layers=low))
    trained = shallow(spec.replace(layers=low + 1))
    frozen = trained if spec.lora else shallow(spec.replace(layers=low + 1, rate=0.5, frozen_state=frozen_state),
                                               freeze_all=True)
    # what the scheduler schedules outside the layers (a tied embedding / LM head) is frozen at the rate too:
    # the frozen layer's increment is taken against the shallow model with that frozen, not against it trained
    # (else a large frozen LM head made each frozen layer cost less than nothing)
    first_frozen = first
    if not spec.lora:
        try:
            first_frozen = shallow(spec.replace(layers=low, rate=0.5, frozen_state=frozen_state), freeze_all=True)
        except Exception:  # noqa: BLE001 - nothing to schedule without layers: the shallow model as it is
            first_frozen = first
    out = []
    for rate in rates:
        f, b, o, r, n, w = _line(first, trained, depth - low, rate, frozen, first_frozen)
        seconds = step_seconds(f, b, o, device, dtype)
        if frozen_state == "offload_all":   # every trained parameter's moments in from the host and back out;
            seconds += host_traffic_seconds(n, spec.moment_bytes)   # none stays resident (the shallow trained runs,
            r = w                                              # without a scheduler, keep theirs)
        out.append((seconds, int(r)))
    return out


def estimate(specs: list[StepSpec], ref: ModelRef, on_progress=None) -> list[Candidate]:
    """A Candidate with its estimated time and resident bytes for each spec (grouped: one set of shallow
    predictions per preset, LoRA and checkpointing). on_progress(line): told of each configuration estimated."""
    depth = _depth(ref)
    groups: dict[tuple, list[StepSpec]] = {}
    for s in specs:
        groups.setdefault((s.preset, s.lora, s.checkpointing, s.step_in_backward, s.frozen_state), []).append(s)
    out, shallow = [], _Shallow(ref)
    for (*_, frozen_state), members in groups.items():
        head = members[0].replace(rate=0.0, frozen_state=None)
        values = _estimate_group(head, ref, depth, [m.rate for m in members], frozen_state, shallow)
        for m, (t, r) in zip(members, values):
            out.append(Candidate(m, est_seconds=t, resident=r))
            if on_progress is not None:
                on_progress(f"[{len(out)}/{len(specs)}] estimated {m.label()}: {t:.3g} s a step, resident {_gib(r)}")
    return out


def _gib(n: float) -> str:
    """Bytes as GiB with two decimals (progress lines)."""
    return f"{n / 2**30:.2f} GiB"


def fit(base: StepSpec, budget_bytes: int, lora_rank: int | None = None, ref: ModelRef | None = None,
        on_candidate=None, on_progress=None) -> FitResult:
    """The fastest (estimated) configuration whose predicted step peak is at most budget_bytes.
    on_candidate(candidate): each candidate predicted in full; on_progress(line): one line per configuration
    estimated, skipped or predicted (the command prints them to stderr: an 8B search takes minutes)."""
    ref = ref or resolve_model(base.model, base.task)
    ranked = sorted(estimate(candidates(base, lora_rank), ref, on_progress),
                    key=lambda c: (c.est_seconds, _preference(c.spec)))
    best = None
    for rank, cand in enumerate(ranked, 1):
        if cand.resident > budget_bytes:
            cand.status = "resident alone too big"
            if on_progress is not None:
                on_progress(f"[{rank}/{len(ranked)}] skipped {cand.spec.label()}: resident {_gib(cand.resident)} "
                            "alone is over the budget")
            continue
        cand.prediction = predict(cand.spec, ref=ref)
        cand.status = "fits" if cand.prediction.total <= budget_bytes else "too big"
        if on_progress is not None:
            on_progress(f"[{rank}/{len(ranked)}] predicted {cand.spec.label()}: step peak "
                        f"{_gib(cand.prediction.total)} ({cand.status}, {cand.prediction.seconds:.1f} s)")
        if on_candidate is not None:
            on_candidate(cand)
        if cand.status == "fits":
            best = cand
            break
    return FitResult(int(budget_bytes), best, ranked)
