"""One fine-tuning run of a sequence classifier, plain or with slimfit, with its measurements."""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass
class RunResult:
    name: str
    accuracy: float
    saved_bytes: int | None          # bytes autograd saved for one training step (CPU accounting), final frozen set
    peak_bytes: int | None           # torch.cuda.max_memory_allocated over training (GPU)
    step_ms: float                   # median training-step time
    frozen_share: float              # mean share of scheduled layers frozen per step
    losses: list = field(default_factory=list)
    trainable_params: int = 0        # parameters that require grad when training starts
    # the most of saved_bytes over the frozen sets of `saved_samples` evenly spaced steps and the final one
    # (the scheduler's trained set changes from step to step); None when not sampled
    saved_bytes_max: int | None = None
    # the total peak of one whole training step after training (weights, gradients, AdamW state, saved
    # activations, temporaries: slimfit.step_memory), final frozen set; None when not measured
    step_peak_bytes: int | None = None


@dataclass
class Prepared:
    """What a method makes of a freshly loaded model before training: the model to train (it
    may be a wrapper, e.g. a PEFT model), an optional freezing scheduler, a display name and an
    optional callback given the dataset indices of each batch, returning extra forward keywords
    (e.g. {"sample_ids": ...} for WTA-CRS) and an optional optimizer factory `optimizer(params, lr)` (None: the
    loop's torch.optim.AdamW(params, lr=lr, weight_decay=0.01))."""
    model: object
    scheduler: object = None
    name: str = ""
    on_batch: Optional[Callable] = None
    optimizer: Optional[Callable] = None


def prepare_preset(preset, rate: float, always_train=None, scheduler_options: dict | None = None,
                   label: str | None = None, optimizer: Callable | None = None) -> Callable:
    """The methods `slimfit demo` compares: plain PyTorch (preset None) or slimfit `preset` (a preset name or a
    SlimFitConfig) + the scheduler at `rate`
    (`always_train`: module names the scheduler leaves out and trains every step; None, the scheduler's
    default: the task head; () schedules it; `scheduler_options`: more ILSScheduler keywords, e.g. frozen_update
    or frozen_state; `optimizer`: Prepared.optimizer, None for the loop's AdamW)."""

    def prepare(model, seed: int) -> Prepared:
        import slimfit
        from slimfit.scheduler import ILSScheduler

        if preset is None:
            return Prepared(model, None, "plain PyTorch", optimizer=optimizer)
        config = slimfit.SlimFitConfig.preset(preset) if isinstance(preset, str) else preset
        slimfit.patch(model, config)
        options = dict(scheduler_options or {})
        scheduler = ILSScheduler(model, freeze_rate=rate, seed=seed, always_train=always_train, **options)
        # the default (the task head trains every step) is said under the table; a choice is named here
        heads = list(scheduler.always_train) if always_train is not None else []
        extras = ([f"{'+'.join(heads)} always trains"] if heads else []) + [f"{k}={v}" for k, v in options.items()]
        name = label or (preset if isinstance(preset, str) else "custom config")
        return Prepared(model, scheduler, f"slimfit {name}, rate {rate}" + "".join(f", {e}" for e in extras),
                        optimizer=optimizer)

    return prepare


def quiet_transformers() -> None:
    """Silence transformers' load reports below errors: every run here builds a classifier whose head is
    newly initialised on purpose, and the report saying so once per model drowns the results."""
    try:
        import transformers
    except ImportError:
        return
    transformers.logging.set_verbosity_error()


def _batches(n: int, batch_size: int, steps: int, seed: int):
    """`steps` lists of dataset indices: seeded epochs of shuffled order, the ragged tail dropped."""
    order = list(range(n))
    rng = random.Random(seed)
    pos = n
    for _ in range(steps):
        if pos + batch_size > n:
            rng.shuffle(order)
            pos = 0
        yield order[pos:pos + batch_size]
        pos += batch_size


def _encode(tokenizer, examples, max_length: int, device):
    enc = tokenizer([t for t, _ in examples], padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    enc["labels"] = torch.tensor([y for _, y in examples])
    return {k: v.to(device) for k, v in enc.items()}


def _progress(iterable, total: int, desc: str, enabled: bool):
    if not enabled:
        return iterable
    try:
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, leave=False)
    except ImportError:
        return iterable


@torch.no_grad()
def evaluate(model, tokenizer, test, max_length: int, device, batch_size: int = 64, progress: bool = True) -> float:
    model.eval()
    correct = 0
    chunks = [test[i:i + batch_size] for i in range(0, len(test), batch_size)]
    for chunk in _progress(chunks, len(chunks), "evaluate", progress):
        batch = _encode(tokenizer, chunk, max_length, device)
        labels = batch.pop("labels")
        correct += int((model(**batch).logits.argmax(-1) == labels).sum())
    return correct / max(len(test), 1)


def count_labels(train, test) -> int:
    """Number of classes of (text, label) lists; labels must be the ints 0..n-1 (the head's rows)."""
    labels = {y for _, y in train} | {y for _, y in test}
    if not labels or not all(isinstance(y, int) and not isinstance(y, bool) for y in labels):
        raise ValueError("labels must be Python ints 0..n-1 (got "
                         f"{sorted(map(repr, labels))[:5] or 'no examples'}); map class names to indices first")
    if min(labels) < 0:
        raise ValueError(f"label {min(labels)} is negative: unlabelled rows (e.g. a hidden test split) cannot train "
                         "or be scored")
    if len({y for _, y in train}) < 2:
        raise ValueError("the training split holds a single class: nothing to learn; use more examples")
    return max(labels) + 1


def finetune(model_dir: str, train, test, *, preset: str | None = None, rate: float = 0.7, steps: int,
             batch_size: int, lr: float, seed: int, max_length: int, device: str = "cpu", progress: bool = True,
             prepare: Callable | None = None, always_train=None, scheduler_options: dict | None = None,
             saved_samples: int = 0) -> RunResult:
    """Fine-tune from `model_dir`; preset None = plain PyTorch, else slimfit with that preset and
    the freezing scheduler at `rate` (with `always_train` and `scheduler_options`, see prepare_preset);
    or any method given as `prepare(model, seed) -> Prepared`.
    Same seed, same batches, same head initialisation. `saved_samples`: see train_and_evaluate."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    prepare = prepare or prepare_preset(preset, rate, always_train, scheduler_options)
    num_labels = count_labels(train, test)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=num_labels).to(device)
    prepared = prepare(model, seed)

    def make_batch(indices):
        return _encode(tokenizer, [train[i] for i in indices], max_length, device)

    return train_and_evaluate(prepared, make_batch, len(train), steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                              device=device, progress=progress, saved_samples=saved_samples,
                              evaluate_fn=lambda m: evaluate(m, tokenizer, test, max_length, device, progress=progress))


def train_and_evaluate(prepared: Prepared, make_batch: Callable, n_train: int, *, steps: int, batch_size: int,
                       lr: float, seed: int, device: str, progress: bool, evaluate_fn: Callable,
                       saved_samples: int = 0) -> RunResult:
    """The training loop shared by the text and image runs: AdamW (or `prepared.optimizer`) over `steps` seeded
    batches (`make_batch(indices)` -> forward keywords), the scheduler if any, then the saved bytes of one
    step on a fixed batch (final frozen state), the peak GPU memory and `evaluate_fn(model)`.
    `saved_samples` > 0 (with a scheduler): the same measurement also after that many evenly spaced
    steps, for the most over the run (`saved_bytes_max`); the RNG state is restored around each, so
    training is the same as without."""
    from slimfit import memory

    model, scheduler = prepared.model, prepared.scheduler
    params, optimizer = _adamw(model, scheduler, lr, prepared.optimizer)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()

    def batch_with_extras(indices):
        batch = make_batch(indices)
        if prepared.on_batch is not None:
            batch.update(prepared.on_batch(indices) or {})
        return batch

    fixed = list(range(batch_size))
    sample_at = set()
    if saved_samples > 0 and scheduler is not None:
        sample_at = {round((i + 1) * steps / (saved_samples + 1)) for i in range(saved_samples)}
    sampled = []

    model.train()
    times, losses, frozen = [], [], []
    for step, indices in enumerate(_progress(_batches(n_train, batch_size, steps, seed), steps, prepared.name,
                                             progress)):
        if step in sample_at:
            sampled.append(_saved_bytes_keeping_rng(model, batch_with_extras(fixed), device))
        batch = batch_with_extras(indices)
        seconds, loss, frozen_share = _timed_step(model, batch, optimizer, scheduler, device)
        if frozen_share is not None:
            frozen.append(frozen_share)
        times.append(seconds)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None

    # Saved-activation bytes of one training step on a fixed batch, in the final frozen state.
    saved = memory.measure(model, **batch_with_extras(fixed)).total
    optimizer.zero_grad(set_to_none=True)

    accuracy = evaluate_fn(model)
    # after the evaluation: this step changes the weights as a training step does
    step_peak = _step_peak(model, batch_with_extras(fixed), optimizer)
    warm = times[min(3, len(times) - 1):] or times
    return RunResult(name=prepared.name, accuracy=accuracy, saved_bytes=saved, peak_bytes=peak,
                     step_peak_bytes=step_peak,
                     step_ms=1000 * statistics.median(warm), frozen_share=statistics.mean(frozen) if frozen else 0.0,
                     losses=losses, trainable_params=sum(p.numel() for p in params),
                     saved_bytes_max=max(sampled + [saved]) if sampled else None)


def _step_peak(model, batch: dict, optimizer) -> int:
    """The total peak of one whole training step (forward, backward, AdamW step, zero_grad) on `batch`, in
    the final frozen set, the optimizer's state as training left it (slimfit.step_memory). The scheduler
    does not step: its counts stay those of the run."""
    from slimfit import step_memory

    model.train()
    return step_memory.measure_step(model, batch, optimizer).total


def _adamw(model, scheduler, lr: float, make_optimizer: Callable | None = None):
    """(the parameters, AdamW over them, or `make_optimizer(params, lr)`): every parameter under a scheduler,
    which freezes and unfreezes layers as it goes (the optimizer must know them all), else those that require
    grad."""
    params = list(model.parameters()) if scheduler is not None else [p for p in model.parameters() if p.requires_grad]
    if make_optimizer is None:
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    else:
        optimizer = make_optimizer(params, lr)
    if scheduler is not None:
        scheduler.attach_optimizer(optimizer)
    return params, optimizer


def _timed_step(model, batch: dict, optimizer, scheduler, device: str):
    """One training step (forward, backward, optimizer step, zero_grad, the scheduler's step):
    (seconds, the loss, the share of scheduled layers frozen after it or None without a scheduler)."""
    start = time.perf_counter()
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    frozen_share = None
    if scheduler is not None:
        scheduler.step()
        frozen_share = scheduler.num_frozen / scheduler.num_layers
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, loss, frozen_share


def _saved_bytes_keeping_rng(model, batch: dict, device: str) -> int:
    """Saved bytes of one step on `batch` with the current frozen set; the RNG states (dropout masks,
    slimfit's seeds) are put back, so the training run goes on as if nothing had been measured."""
    from slimfit import memory

    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state() if device.startswith("cuda") else None
    try:
        return memory.measure(model, **batch).total
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state)
