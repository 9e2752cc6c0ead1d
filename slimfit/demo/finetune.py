"""One fine-tuning run of a sequence classifier, plain or with slimfit, with its measurements."""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import torch


@dataclass
class RunResult:
    name: str
    accuracy: float
    saved_bytes: int | None          # bytes autograd saved for one training step (CPU accounting)
    peak_bytes: int | None           # torch.cuda.max_memory_allocated over training (GPU)
    step_ms: float                   # median training-step time
    frozen_share: float              # mean share of scheduled layers frozen per step
    losses: list = field(default_factory=list)


def _batches(data, batch_size: int, steps: int, seed: int):
    order = list(range(len(data)))
    rng = random.Random(seed)
    pos = len(order)
    for _ in range(steps):
        if pos + batch_size > len(order):
            rng.shuffle(order)
            pos = 0
        yield [data[i] for i in order[pos:pos + batch_size]]
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


def finetune(model_dir: str, train, test, *, preset: str | None, rate: float, steps: int, batch_size: int,
             lr: float, seed: int, max_length: int, device: str = "cpu", progress: bool = True) -> RunResult:
    """Fine-tune from `model_dir`; preset None = plain PyTorch, else slimfit with that preset and
    the freezing scheduler at `rate`. Same seed, same batches, same head initialisation."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    import slimfit
    from slimfit import memory
    from slimfit.scheduler import ILSScheduler

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2).to(device)
    scheduler = None
    if preset is not None:
        slimfit.patch(model, slimfit.SlimFitConfig.preset(preset))
        scheduler = ILSScheduler(model, freeze_rate=rate, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    if scheduler is not None:
        scheduler.attach_optimizer(optimizer)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()

    model.train()
    times, losses, frozen = [], [], []
    name = "plain PyTorch" if preset is None else f"slimfit {preset}, rate {rate}"
    for batch_examples in _progress(_batches(train, batch_size, steps, seed), steps, name, progress):
        batch = _encode(tokenizer, batch_examples, max_length, device)
        start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
            frozen.append(scheduler.num_frozen / scheduler.num_layers)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None

    # Saved-activation bytes of one training step on a fixed batch, in the final frozen state.
    probe = _encode(tokenizer, train[:batch_size], max_length, device)
    saved = memory.measure(model, **probe).total
    optimizer.zero_grad(set_to_none=True)

    accuracy = evaluate(model, tokenizer, test, max_length, device, progress=progress)
    warm = times[min(3, len(times) - 1):] or times
    return RunResult(name=name, accuracy=accuracy, saved_bytes=saved, peak_bytes=peak,
                     step_ms=1000 * statistics.median(warm), frozen_share=statistics.mean(frozen) if frozen else 0.0,
                     losses=losses)
