"""One fine-tuning run of an image classifier (DINOv2 ViT-S/14 on Fashion-MNIST), plain or with
any method given as `prepare(model, seed) -> Prepared`; the image twin of finetune.finetune."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from .finetune import RunResult, _batches, _progress, prepare_preset


@torch.no_grad()
def evaluate_images(model, pixels: torch.Tensor, labels: torch.Tensor, device, batch_size: int = 128,
                    progress: bool = True) -> float:
    model.eval()
    correct = 0
    starts = list(range(0, len(labels), batch_size))
    for s in _progress(starts, len(starts), "evaluate", progress):
        logits = model(pixel_values=pixels[s:s + batch_size].to(device)).logits
        correct += int((logits.argmax(-1).cpu() == labels[s:s + batch_size]).sum())
    return correct / max(len(labels), 1)


def finetune_images(build_model: Callable, train, test, *, steps: int, batch_size: int, lr: float, seed: int,
                    device: str = "cpu", progress: bool = True, prepare: Callable | None = None,
                    preset: str | None = None, rate: float = 0.9) -> RunResult:
    """train / test: (pixels float [N,3,H,W], labels int64 [N]); build_model() -> a fresh classifier
    taking pixel_values (+ labels). Same seed: same batches, same head initialisation."""
    from slimfit import memory

    prepare = prepare or prepare_preset(preset, rate)
    (x_train, y_train), (x_test, y_test) = train, test
    torch.manual_seed(seed)
    model = build_model().to(device)
    model.train()
    prepared = prepare(model, seed)
    model, scheduler = prepared.model, prepared.scheduler
    params = list(model.parameters()) if scheduler is not None else [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    if scheduler is not None:
        scheduler.attach_optimizer(optimizer)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()

    def batch_of(indices):
        idx = torch.tensor(indices)
        batch = {"pixel_values": x_train[idx].to(device), "labels": y_train[idx].to(device)}
        if prepared.on_batch is not None:
            batch.update(prepared.on_batch(indices) or {})
        return batch

    times, losses, frozen = [], [], []
    for indices in _progress(_batches(len(y_train), batch_size, steps, seed), steps, prepared.name, progress):
        batch = batch_of(indices)
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
    saved = memory.measure(model, **batch_of(list(range(batch_size)))).total
    optimizer.zero_grad(set_to_none=True)
    accuracy = evaluate_images(model, x_test, y_test, device, progress=progress)
    warm = times[min(3, len(times) - 1):] or times
    return RunResult(name=prepared.name, accuracy=accuracy, saved_bytes=saved, peak_bytes=peak,
                     step_ms=1000 * statistics.median(warm), frozen_share=statistics.mean(frozen) if frozen else 0.0,
                     losses=losses, trainable_params=sum(p.numel() for p in params))
