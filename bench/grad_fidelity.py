#!/usr/bin/env python
"""How close each preset's (and each single compression's) weight gradients are to the exact
ones, on the pretrained models of bench/accuracy.py and one real batch: MiniLM-L6 on Rotten
Tomatoes (seq <= 48) and DINOv2 ViT-S/14 on Fashion-MNIST (56x56, 17 tokens).

    python -m bench.grad_fidelity                   # both models, seeds 0,1,2
    python -m bench.grad_fidelity --models dinov2 --seeds 0
    python -m bench.grad_fidelity --scheduled-kinds matmul --name grad_fidelity_default_kinds \
        --configs "trained LayerNorm x̂ int8,paper(),paper() with trained x̂ in full"
                                                    # the library's default trained set (every norm
                                                    # weight trains): bench/results/<name>_cpu.{csv,md}

For each seed the freezing scheduler (rate 0.9; --scheduled-kinds, default "all": every kind of
layer scheduled, the protocol of the committed table) picks the trained set (its first frozen set,
bench/_measure.frozen_set); every config then runs one forward/backward on the same batch with that
set (bench/_measure.configured: patched, frozen, undone after; eval mode: no dropout, so the only
difference from exact() is the compression). Models and batch: bench/_measure.py's pretrained
builders. Reported per config: cosine similarity and relative error of all trainable gradients
concatenated (global), and the worst per-tensor cosine. Writes bench/results/grad_fidelity_cpu.{csv,md}.

Why: a gradient that points elsewhere costs accuracy no matter how many steps are run, so this
separates "compression is too lossy for this model" from "freezing needs more steps".
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/grad_fidelity.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import statistics
import sys

import torch

from bench import _measure, _results
from slimfit import SlimFitConfig
from slimfit.training.finetune import quiet_transformers

EXACT = SlimFitConfig.exact()
# Eval mode has no attention dropout, so 'auto' would take PyTorch's fused kernel (P recomputed from
# Q̃, K̃ in backward); the rows about P force slimfit's materializing core, the path a training step
# with attention dropout takes on the CPU.
MATERIALIZE = EXACT.with_attention(path="materialize")
PAPER_MATERIALIZE = SlimFitConfig.paper().with_attention(path="materialize")  # P recomputed either way
# One compression at a time (on top of exact()), then the presets.
CONFIGS = {
    "GELU input 4-bit": EXACT.replace(gelu_bits=4),
    "GELU input 8-bit": EXACT.replace(gelu_bits=8),
    "FFN-out input 8-bit": EXACT.replace(ffn_out_input_bits=8),
    "Q/K/V 8-bit, fused path": EXACT.with_attention(qkv_bits=8),
    "Q/K/V 8-bit, P full": MATERIALIZE.with_attention(qkv_bits=8),
    "P top-10%": MATERIALIZE.with_experimental(topk_probs=True, keep_ratio=0.1),
    "P int8": MATERIALIZE.with_attention(probs="int8"),
    "Q/K/V 8-bit + P int8": MATERIALIZE.with_attention(qkv_bits=8, probs="int8"),
    "Q/K/V 8-bit + P recomputed": MATERIALIZE.with_attention(qkv_bits=8, probs="recompute"),
    "frozen LayerNorm x̂ top-10%": EXACT.with_experimental(topk_norms="frozen", keep_ratio=0.1),
    "frozen LayerNorm x̂ int8": EXACT.replace(layernorm_frozen="int8"),
    "trained LayerNorm x̂ int8": EXACT.replace(layernorm="int8"),
    # the SlimFit research code's choices (bench/accuracy.py's paper_code)
    "paper() with frozen x̂ top-10% and P int8": PAPER_MATERIALIZE.with_experimental(
        topk_norms="frozen").with_attention(probs="int8"),
    "paper() with P int8": PAPER_MATERIALIZE.with_attention(probs="int8"),
    "paper() with P top-10%": PAPER_MATERIALIZE.with_experimental(topk_probs=True, keep_ratio=0.1),
    "paper() with frozen x̂ top-10%": PAPER_MATERIALIZE.with_experimental(topk_norms="frozen"),
    "paper() with GELU 8-bit": PAPER_MATERIALIZE.replace(gelu_bits=8),
    # bench/accuracy.py's paper_lnfull
    "paper() with trained x̂ in full": PAPER_MATERIALIZE.replace(layernorm="full"),
    "paper()": PAPER_MATERIALIZE,
    "paper(), fused path": SlimFitConfig.paper(),
    "aggressive()": SlimFitConfig.aggressive().with_attention(path="materialize"),
}


def _minilm(batch_size: int):
    from slimfit.demo import assets

    train, _ = assets.rotten_tomatoes(0, 8000, 2000)
    batch = _measure.text_batch(_measure.minilm_tokenizer(), train[:batch_size], max_length=48)
    return lambda: _measure.minilm(num_labels=2, seed=0), batch  # seed: same head for every config


def _dinov2(batch_size: int):
    pixels, labels = _measure.fashion_mnist("train", batch_size, image_size=56)
    return lambda: _measure.dinov2(num_labels=10, image_size=56, seed=0), {"pixel_values": pixels, "labels": labels}


MODELS = {"minilm": ("all-MiniLM-L6-v2, Rotten Tomatoes, seq <= 48", _minilm),
          "dinov2": ("DINOv2 ViT-S/14, Fashion-MNIST, 56x56", _dinov2)}


def gradients(build, batch, config, seed: int, rate: float, kinds="all") -> dict[str, torch.Tensor]:
    """The trained parameters' gradients of one forward/backward, `config` patched (None: exact PyTorch)."""
    model = build()
    frozen, _ = _measure.frozen_set(model, rate, seed, scheduled_kinds=kinds)
    with _measure.configured(model, batch, config=config, frozen=frozen):
        model.eval()
        model(**batch).loss.backward()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    if ref.keys() != got.keys():
        raise RuntimeError(f"trained sets differ: {sorted(ref.keys() ^ got.keys())[:4]}")
    a = torch.cat([ref[n].flatten().double() for n in ref])
    b = torch.cat([got[n].flatten().double() for n in ref])
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    rel = float((a - b).norm() / a.norm())
    # Worst tensor among those that carry gradient: a key bias's exact gradient is 0 up to rounding
    # (softmax is shift invariant), so its cosine is noise.
    floor = 1e-3 * max(float(g.norm()) for g in ref.values())
    worst = min(float(torch.nn.functional.cosine_similarity(ref[n].flatten().double(), got[n].flatten().double(),
                                                            dim=0))
                for n in ref if float(ref[n].norm()) > floor)
    return cos, rel, worst


def median_rows(rows: list[dict], model: str, names=None) -> list[list[str]]:
    """Per config of `names` (default CONFIGS): the medians over seeds of the CSV rows of `model`, as table cells."""
    out = []
    for name in names or CONFIGS:
        rs = [r for r in rows if r["model"] == model and r["config"] == name]
        med = {k: statistics.median(float(r[k]) for r in rs) for k in ("cos", "rel_err", "worst_tensor_cos")}
        out.append([name, f"{med['cos']:.4f}", f"{med['rel_err']:.3g}", f"{med['worst_tensor_cos']:.3f}"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="minilm,dinov2")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rate", type=float, default=0.9)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out-dir", default=None, help="default bench/results")
    p.add_argument("--scheduled-kinds", default="all",
                   help="ILSScheduler scheduled_kinds: 'all' (the committed table) or e.g. 'matmul' (the default)")
    p.add_argument("--configs", default=None, help="comma-separated config names (default: all of them)")
    p.add_argument("--name", default="grad_fidelity", help="results file name (bench/results/<name>_cpu.*)")
    args = p.parse_args(argv)
    kinds = args.scheduled_kinds if args.scheduled_kinds == "all" else tuple(args.scheduled_kinds.split(","))
    names = list(CONFIGS) if args.configs is None else [c.strip() for c in args.configs.split(",")]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; known: {list(CONFIGS)}")
    quiet_transformers()
    rows = []
    for key in args.models.split(","):
        title, make = MODELS[key]
        build, batch = make(args.batch_size)
        for seed in (int(s) for s in args.seeds.split(",")):
            ref = gradients(build, batch, None, seed, args.rate, kinds)
            for name in names:
                cos, rel, worst = compare(ref, gradients(build, batch, CONFIGS[name], seed, args.rate, kinds))
                rows.append({"model": key, "config": name, "seed": seed, "cos": f"{cos:.5f}", "rel_err": f"{rel:.4g}",
                             "worst_tensor_cos": f"{worst:.4f}", "trained_tensors": len(ref)})
                print(f"{key:7s} seed {seed} {name:56s} cos {cos:.5f}  rel {rel:.3g}  worst tensor cos {worst:.4f}",
                      flush=True)
    _results.write_rows(_results.results_path(args.name, "csv", "cpu", args.out_dir), rows)
    versions = _results.versions()
    lines = ["# Gradient fidelity on pretrained models (one real batch)", "",
             f"Batch {args.batch_size}, scheduler rate {args.rate} (its first trained set per seed; scheduled kinds: "
             f"{args.scheduled_kinds}), eval mode, "
             f"fp32, torch {versions['torch']}; `{_results.command('grad_fidelity', argv)}`. Median over seeds "
             f"{args.seeds} of: cosine and relative error of all trainable gradients vs exact(), worst per-tensor "
             f"cosine (tensors with at least 1e-3 of the largest tensor's gradient norm). Rows with P and the "
             f"paper()/aggressive() rows force slimfit's materializing attention core (attention.path='materialize': "
             f"the path of a CPU training step with attention dropout); 'fused path' rows let 'auto' take PyTorch's "
             f"fused kernel (eval mode has no dropout).", ""]
    for key in args.models.split(","):
        lines += [f"## {MODELS[key][0]}", ""] + _results.md_table(
            ["config", "cos", "rel err", "worst tensor cos"], median_rows(rows, key, names), right=(1, 2, 3)) + [""]
    _results.write_text(_results.results_path(args.name, "md", "cpu", args.out_dir), "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
