"""One fine-tuning run of an image classifier (DINOv2 ViT-S/14 on Fashion-MNIST), plain or with
any method given as `prepare(model, seed) -> Prepared`; the image twin of slimfit.training.finetune.finetune,
used by bench/accuracy.py --task fashion_mnist."""
from __future__ import annotations

from typing import Callable

import torch

from slimfit.training.finetune import RunResult, _progress, prepare_preset, train_and_evaluate


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
                    preset: str | None = None, rate: float = 0.7) -> RunResult:
    """train / test: (pixels float [N,3,H,W], labels int64 [N]); build_model() -> a fresh classifier
    taking pixel_values (+ labels). Same seed: same batches, same head initialisation."""
    prepare = prepare or prepare_preset(preset, rate)
    (x_train, y_train), (x_test, y_test) = train, test
    torch.manual_seed(seed)
    model = build_model().to(device)
    model.train()
    prepared = prepare(model, seed)

    def make_batch(indices):
        idx = torch.tensor(indices)
        return {"pixel_values": x_train[idx].to(device), "labels": y_train[idx].to(device)}

    return train_and_evaluate(prepared, make_batch, len(y_train), steps=steps, batch_size=batch_size, lr=lr,
                              seed=seed, device=device, progress=progress,
                              evaluate_fn=lambda m: evaluate_images(m, x_test, y_test, device, progress=progress))
