"""Saved-activation bytes, step time and gradient error of a BERT-base-shaped encoder stack:
plain PyTorch eager vs the same stack built from slimfit's autograd functions.

    python -m bench.layer_memory [--batch N] [--repeats R] [--csv PATH]

The stack: 12 post-LN encoder layers, hidden 768, 12 heads, FFN 3072, sequence 128, dropout 0.1,
randomly initialised modules defined here (no downloads). One set of parameters, two forwards:

* plain  -- nn.Linear, F.gelu, softmax attention (matmul, softmax, nn.Dropout-style dropout,
            matmul), nn.LayerNorm, nn.Dropout; every weight trainable (what users run today).
* slimfit -- slimfit.autograd.{linear, gelu, attention, layer_norm, dropout}; 95% of the linear
            weights (and 95% of the LayerNorm weights) frozen at random (seeded), biases
            trainable as in the SlimFit code; GELU input 4-bit; Q/K/V 8-bit; P top-10%;
            LayerNorm x̂ top-10% when its weight is frozen, int8 when it trains; seeded dropout
            (nothing saved); inputs of the few trainable linears 8-bit.

Rows: plain (all trainable; the baseline), plain with PyTorch's fused SDPA attention (attention
dropout off: on the CPU SDPA with dropout falls back to the math kernel), plain with the same
frozen set (freezing alone),
slimfit as above (the issue's configuration; the >= 8x target applies to it), slimfit with P
at int8 (the SlimFit code's format for P), slimfit with P and every LayerNorm x̂ at int8 (no
top-k at all), slimfit with the trainable linears' inputs in fp32.
`--ablation` adds the gradient error of each compression alone; `--flat-check` the error of P's
compression when attention is near-uniform.

Saved bytes are counted with slimfit.memory.measure through bench/_measure.py (saved-tensor hooks,
parameters excluded, shared storages once; per component by _measure.saved_by_group) and reported
per sample. Step time is forward + backward (bench/_timing.py: median of --repeats after one
warm-up). The stack, its step (no optimizer) and its frozen set (per weight, not the scheduler's
per-layer set) are this script's own: no transformers model has them. Gradient error: the trainable
parameters' gradients of the slimfit stack against an exact fp32 run of the same frozen stack in
plain PyTorch (dropout off in both, same input and upstream gradient).

Q/K projection init: std 0.0625 (others 0.02, BERT's init) so that attention logits have std ≈ 3
and softmax rows are peaked as in a trained BERT (mean row entropy ≈ 2.2 nats of 4.85). With
BERT's init std 0.02 everywhere, attention is almost uniform (logit std ≈ 0.3), the regime where
top-10% of P is a poor summary; `--qk-std 0.02` measures that case (reported too).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/layer_memory.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("SLIMFIT_BACKEND", "auto")

import torch
import torch.nn as nn
import torch.nn.functional as F

import slimfit
from bench import _measure, _results, _timing
from slimfit import memory
from slimfit.autograd import attention, dropout, gelu, layer_norm, linear
from slimfit.kernels import backend_info

MiB = 1024 * 1024


# ---------------------------------------------------------------------------- the stack
class Mode:
    """Which forward every component runs, and the slimfit settings (one shared object)."""

    def __init__(self):
        self.kind = "plain"          # 'plain' | 'slimfit'
        self.training = True
        self.p = 0.1
        self.linear_bits = 8         # trainable linears' saved input: 8 / 4 bits or None (fp32)
        self.gelu_bits = 4
        self.qkv_bits = 8
        self.probs = "topk"
        self.keep_ratio = 0.1
        self.ln_frozen_save = "topk"  # x̂ of a LayerNorm whose weight is frozen; int8 when it trains
        self.ln_trainable_save = "int8"
        self.plain_attention = "eager"  # plain mode: 'eager' softmax attention or 'sdpa'
        self.attn_dropout = True        # attention dropout on (hidden dropout is always on)


class Linear(nn.Linear):
    def __init__(self, mode: Mode, n_in: int, n_out: int, std: float):
        super().__init__(n_in, n_out)
        self.mode = [mode]  # in a list: not a submodule
        nn.init.normal_(self.weight, std=std)
        nn.init.zeros_(self.bias)

    def forward(self, x):
        m = self.mode[0]
        if m.kind == "plain":
            return super().forward(x)
        return linear(x, self.weight, self.bias, input_bits=m.linear_bits)


class LayerNorm(nn.LayerNorm):
    def __init__(self, mode: Mode, d: int):
        super().__init__(d)
        self.mode = [mode]

    def forward(self, x):
        m = self.mode[0]
        if m.kind == "plain":
            return super().forward(x)
        save = m.ln_trainable_save if self.weight.requires_grad else m.ln_frozen_save
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps,
                          save=save, keep_ratio=m.keep_ratio)


class GELU(nn.Module):
    def __init__(self, mode: Mode):
        super().__init__()
        self.mode = [mode]

    def forward(self, x):
        m = self.mode[0]
        if m.kind == "plain" or m.gelu_bits is None:
            return F.gelu(x)
        return gelu(x, bits=m.gelu_bits)


class Dropout(nn.Module):
    def __init__(self, mode: Mode):
        super().__init__()
        self.mode = [mode]

    def forward(self, x):
        m = self.mode[0]
        if m.kind == "plain":
            return F.dropout(x, m.p, m.training)
        return dropout(x, m.p, m.training, mode="seed")


class AttentionCore(nn.Module):
    """softmax(QKᵀ/√d)·V with attention dropout on P."""

    def __init__(self, mode: Mode):
        super().__init__()
        self.mode = [mode]

    def forward(self, q, k, v):
        m = self.mode[0]
        p = m.p if m.attn_dropout else 0.0
        if m.kind == "plain" and m.plain_attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p if m.training else 0.0)
        if m.kind == "plain":
            s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            return torch.matmul(F.dropout(torch.softmax(s, dim=-1), p, m.training), v)
        return attention(q, k, v, dropout_p=p, training=m.training, qkv_bits=m.qkv_bits,
                         probs=m.probs, keep_ratio=m.keep_ratio)


class EncoderLayer(nn.Module):
    def __init__(self, mode: Mode, hidden=768, heads=12, ffn=3072, qk_std=0.0625):
        super().__init__()
        self.heads = heads
        self.q = Linear(mode, hidden, hidden, qk_std)
        self.k = Linear(mode, hidden, hidden, qk_std)
        self.v = Linear(mode, hidden, hidden, 0.02)
        self.o = Linear(mode, hidden, hidden, 0.02)
        self.core = AttentionCore(mode)
        self.drop1 = Dropout(mode)
        self.ln1 = LayerNorm(mode, hidden)
        self.ffn1 = Linear(mode, hidden, ffn, 0.02)
        self.act = GELU(mode)
        self.ffn2 = Linear(mode, ffn, hidden, 0.02)
        self.drop2 = Dropout(mode)
        self.ln2 = LayerNorm(mode, hidden)

    def forward(self, x):
        b, s, h = x.shape

        def heads(t):  # (B, S, H·D) -> (B, H, S, D), a strided view
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        a = self.core(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)))
        a = a.transpose(1, 2).reshape(b, s, h)
        x = self.ln1(x + self.drop1(self.o(a)))
        return self.ln2(x + self.drop2(self.ffn2(self.act(self.ffn1(x)))))


class Encoder(nn.Module):
    def __init__(self, layers=12, qk_std=0.0625, **kw):
        super().__init__()
        self.mode = Mode()
        self.layers = nn.ModuleList(EncoderLayer(self.mode, qk_std=qk_std, **kw) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build(seed: int, qk_std: float, layers: int = 12) -> Encoder:
    torch.manual_seed(seed)
    return Encoder(layers=layers, qk_std=qk_std)


def frozen_set(model: Encoder, rate: float, seed: int) -> set[str]:
    """Names of the weights to freeze: round(rate·n) of the linear weights and of the LayerNorm
    weights, drawn with a seeded generator. Biases always train (as in the SlimFit code)."""
    g = torch.Generator().manual_seed(seed)
    names = set()
    for kind in (Linear, LayerNorm):
        ws = [f"{n}.weight" for n, m in model.named_modules() if type(m) is kind]
        perm = torch.randperm(len(ws), generator=g).tolist()
        names.update(ws[i] for i in perm[: round(rate * len(ws))])
    return names


def set_trainable(model: Encoder, frozen: set[str]) -> None:
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)


# ---------------------------------------------------------------------------- measurements
COMPONENTS = [  # (label, module names)
    ("Q/K/V linear inputs", ("q", "k", "v")),
    ("attention core (Q,K,V,P,mask)", ("core",)),
    ("out-proj linear input", ("o",)),
    ("FFN linear inputs", ("ffn1", "ffn2")),
    ("GELU", ("act",)),
    ("LayerNorm", ("ln1", "ln2")),
    ("dropout", ("drop1", "drop2")),
]


def by_component(run: memory.SavedMemory) -> dict[str, int]:
    """Saved bytes per COMPONENTS label (a module path's last name), the rest as "other"."""
    groups = [(label, lambda path, names=names: path.split(".")[-1] in names) for label, names in COMPONENTS]
    return _measure.saved_by_group(run, groups)


def saved(model: Encoder, x: torch.Tensor, g: torch.Tensor) -> memory.SavedMemory:
    return _measure.saved_of(model, x, loss_fn=lambda out: (out * g).sum())


def step_time(model: Encoder, x: torch.Tensor, g: torch.Tensor, repeats: int):
    """Median forward+backward time over `repeats` steps; the warm-up step (not timed) is the
    saved-bytes measurement. Returns (seconds, SavedMemory)."""
    run = saved(model, x, g)
    model.zero_grad(set_to_none=True)

    def step():
        model(x).backward(g)
        model.zero_grad(set_to_none=True)

    return _timing.bench(step, "cpu", _timing.Settings.fixed(repeats)).ms / 1e3, run


def trainable_grads(model: Encoder, x, g) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).backward(g)
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out


def exact_grads(model: Encoder, x, g) -> dict[str, torch.Tensor]:
    """Trainable parameters' gradients of plain fp32 PyTorch, dropout off (the reference)."""
    mode = model.mode
    kind, mode.kind, mode.training = mode.kind, "plain", False
    try:
        return trainable_grads(model, x, g)
    finally:
        mode.kind, mode.training = kind, True


# The key bias's exact gradient is identically zero (softmax is shift-invariant per row: the
# bias adds q·b_k to every logit of a row), so its "relative error" is noise over roundoff.
def _scored(name: str) -> bool:
    return not name.endswith(".k.bias")


def grad_error(model: Encoder, x, g, ref: dict[str, torch.Tensor]) -> dict:
    """The model's current slimfit settings, dropout off, vs `ref` (exact_grads)."""
    mode = model.mode
    kind, mode.kind, mode.training = mode.kind, "slimfit", False
    try:
        got = trainable_grads(model, x, g)
    finally:
        mode.kind, mode.training = kind, True
    names = [n for n in ref if _scored(n)]
    num = sum(((got[n] - ref[n]).double().norm() ** 2).item() for n in names)
    den = sum((ref[n].double().norm() ** 2).item() for n in names)
    per = {n: ((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)).item() for n in names}
    cosines = {n: F.cosine_similarity(got[n].flatten(), ref[n].flatten(), dim=0).item() for n in names}
    return {
        "global_rel": math.sqrt(num / den),
        "median_rel": statistics.median(per.values()),
        "max_rel": max(per.values()),
        "max_rel_name": max(per, key=per.get),
        "min_cos": min(cosines.values()),
        "min_cos_name": min(cosines, key=cosines.get),
        "weights_rel": {n: per[n] for n in names if n.endswith("weight")},
        "n_trainable": len(names),
    }


SLIMFIT_MAIN = dict(linear_bits=8, gelu_bits=4, qkv_bits=8, probs="topk", keep_ratio=0.1,
                    ln_frozen_save="topk", ln_trainable_save="int8")
EXACT_SETTINGS = dict(linear_bits=None, gelu_bits=None, qkv_bits=None, probs="full",
                      ln_frozen_save="full", ln_trainable_save="full")
ABLATIONS = [  # (label, settings on top of EXACT_SETTINGS): one compression at a time
    ("trainable-linear inputs int8", dict(linear_bits=8)),
    ("GELU input 4-bit", dict(gelu_bits=4)),
    ("GELU input 8-bit", dict(gelu_bits=8)),
    ("Q/K/V 8-bit", dict(qkv_bits=8)),
    ("P top-10%", dict(probs="topk")),
    ("P int8", dict(probs="int8")),
    ("P int4", dict(probs="int4")),
    ("LayerNorm x̂ top-10% (frozen) / int8", dict(ln_frozen_save="topk", ln_trainable_save="int8")),
    ("LayerNorm x̂ int8", dict(ln_frozen_save="int8", ln_trainable_save="int8")),
]


def configure(mode: Mode, **settings) -> None:
    for k, v in settings.items():
        if not hasattr(mode, k):
            raise AttributeError(k)
        setattr(mode, k, v)


def device_name() -> str:
    return f"cpu ({_results.cpu_model()}, {torch.get_num_threads()} threads)"


def write_csv(path: Path, rows: list[dict]) -> None:
    """Upsert rows keyed by (device, torch, backend, layers, batch, seq, config): a row measured again replaces
    its old one in place; rows of an older column set are dropped."""
    key = ("device", "torch", "backend", "layers", "batch", "seq", "config")
    old = [r for r in _results.read_rows(str(path)) if set(r) == set(rows[0])]
    _results.write_rows(str(path), _results.merge_rows(old, rows, key), list(rows[0]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2, help="batch size for the CPU measurements (2-4)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=12, help="encoder layers (12 = BERT-base; fewer for a smoke run)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per config (median)")
    ap.add_argument("--freeze", type=float, default=0.95, help="fraction of weights frozen")
    ap.add_argument("--qk-std", type=float, default=0.0625, help="init std of the Q/K projections")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", type=Path, default=Path(_results.results_path("layer_memory", "csv", "cpu")))
    ap.add_argument("--ablation", action="store_true",
                    help="also measure the gradient error of each compression alone (9 more steps)")
    ap.add_argument("--flat-check", action="store_true",
                    help="also measure P's gradient error with BERT's init std 0.02 for Q/K (flat attention)")
    args = ap.parse_args(argv)

    b, s, hidden = args.batch, args.seq, 768
    model = build(args.seed, args.qk_std, args.layers)
    frozen = frozen_set(model, args.freeze, args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(b, s, hidden, generator=gen)
    g = torch.randn(b, s, hidden, generator=gen)
    mode = model.mode
    n_lin = sum(1 for m in model.modules() if type(m) is Linear)
    n_ln = sum(1 for m in model.modules() if type(m) is LayerNorm)
    f_lin = sum(1 for n in frozen if any(n.endswith(f".{k}.weight") for k in ("q", "k", "v", "o", "ffn1", "ffn2")))
    print(f"slimfit {slimfit.__version__}, torch {torch.__version__}, {device_name()}, "
          f"kernels: {backend_info()['cpu']}")
    print(f"stack: {args.layers} layers, hidden 768, 12 heads, FFN 3072, seq {s}, batch {b}, dropout 0.1; "
          f"frozen: {f_lin}/{n_lin} linear weights, {len(frozen) - f_lin}/{n_ln} LayerNorm weights "
          f"(seed {args.seed}); trainable linears: "
          + ", ".join(sorted(n[:-7] for n, p in model.named_parameters()
                             if n.endswith("weight") and n not in frozen and "ln" not in n)))

    results = []

    def record(config, run, t=None, err=None):
        results.append(dict(config=config, run=run, time=t, err=err))

    # 1. plain, everything trainable (the baseline users have)
    mode.kind = "plain"
    set_trainable(model, set())
    t, run = step_time(model, x, g, args.repeats)
    record("plain eager, all trainable", run, t)
    # 1b. plain with PyTorch's fused attention (SDPA). On the CPU SDPA falls back to the math
    # kernel when dropout is on (saving even more), so this row runs without attention dropout:
    # it shows what the fused (flash) path saves, as on a GPU.
    configure(mode, plain_attention="sdpa", attn_dropout=False)
    record("plain, SDPA attention (no attn dropout)", saved(model, x, g))
    configure(mode, plain_attention="eager", attn_dropout=True)
    # 2. plain with the same frozen set (what freezing alone gives)
    set_trainable(model, frozen)
    record("plain eager, same frozen set", saved(model, x, g))
    ref = exact_grads(model, x, g)
    # 3. slimfit, the configuration of the issue (P top-10%, x̂ top-10% when frozen)
    mode.kind = "slimfit"
    configure(mode, **SLIMFIT_MAIN)
    t, run = step_time(model, x, g, args.repeats)
    record("slimfit (P top-10%)", run, t, grad_error(model, x, g, ref))
    # 4. P saved at int8 instead (the SlimFit research code's choice)
    configure(mode, probs="int8")
    record("slimfit, P int8", saved(model, x, g), None, grad_error(model, x, g, ref))
    # 5. P and every LayerNorm x̂ at int8 (no top-k anywhere)
    configure(mode, probs="int8", ln_frozen_save="int8")
    record("slimfit, P int8, LN x̂ int8", saved(model, x, g), None, grad_error(model, x, g, ref))
    # 6. the issue's configuration with the trainable linears' inputs in fp32
    configure(mode, **SLIMFIT_MAIN)
    configure(mode, linear_bits=None)
    record("slimfit, trainable-linear inputs fp32", saved(model, x, g))
    configure(mode, **SLIMFIT_MAIN)

    base = results[0]["run"].total
    print()
    head = f"{'config':46s} {'saved MiB/sample':>17s} {'vs plain':>9s} {'step ms (B=' + str(b) + ')':>15s} " \
           f"{'grad rel err':>13s} {'min cos':>8s}"
    print(head)
    print("-" * len(head))
    for i, r in enumerate(results):
        per = r["run"].total / b
        ratio = base / r["run"].total if r["run"].total else float("inf")
        t = f"{1000 * r['time']:15.0f}" if r["time"] is not None else f"{'-':>15s}"
        e = r["err"]
        es = f"{e['global_rel']:13.2e} {e['min_cos']:8.4f}" if e else f"{'-':>13s} {'-':>8s}"
        print(f"{'(' + str(i + 1) + ') ' + r['config']:46s} {per / MiB:17.2f} {ratio:8.2f}x {t} {es}")
    print("(grad rel err: ||g - g_exact|| / ||g_exact|| over all trainable tensors but the key biases, "
          "whose exact gradient is 0; vs plain fp32 of the same frozen stack, dropout off)")

    print(f"\nper component, MiB/sample ({args.layers} layers):")
    comps = [by_component(r["run"]) for r in results]
    print(f"{'component':30s}" + "".join(f"{'(' + str(i + 1) + ')':>9s}" for i in range(len(results))))
    for label in [c[0] for c in COMPONENTS] + ["other"]:
        print(f"{label:30s}" + "".join(f"{cm[label] / b / MiB:9.2f}" for cm in comps))
    print("columns: " + "; ".join(f"({i + 1}) {r['config']}" for i, r in enumerate(results)))

    main_i = next(i for i, r in enumerate(results) if r["config"] == "slimfit (P top-10%)")
    int8_i = next(i for i, r in enumerate(results) if r["config"] == "slimfit, P int8")
    e = results[main_i]["err"]
    print(f"\nslimfit (P top-10%): {e['n_trainable']} trainable tensors; rel err median {e['median_rel']:.2e}, "
          f"max {e['max_rel']:.2e} ({e['max_rel_name']}), min cos {e['min_cos']:.4f} ({e['min_cos_name']}); "
          "trainable weights:")
    for n, v in sorted(e["weights_rel"].items()):
        print(f"    {n:28s} rel err {v:.2e}   (P int8: {results[int8_i]['err']['weights_rel'][n]:.2e})")

    ablation = []
    if args.ablation:
        print("\ngradient error of one compression at a time (everything else exact):")
        for label, settings in ABLATIONS:
            configure(mode, **EXACT_SETTINGS)
            configure(mode, **settings)
            err = grad_error(model, x, g, ref)
            ablation.append((label, err))
            print(f"    {label:40s} global rel {err['global_rel']:.2e}  median {err['median_rel']:.2e}  "
                  f"min cos {err['min_cos']:.4f}")
        configure(mode, **SLIMFIT_MAIN)

    flat_err = None
    if args.flat_check and args.qk_std != 0.02:
        flat = build(args.seed, 0.02, args.layers)
        set_trainable(flat, frozen)
        flat_ref = exact_grads(flat, x, g)
        flat.mode.kind = "slimfit"
        configure(flat.mode, **EXACT_SETTINGS)
        configure(flat.mode, probs="topk")
        flat_err = grad_error(flat, x, g, flat_ref)
        configure(flat.mode, probs="int8")
        flat_int8 = grad_error(flat, x, g, flat_ref)
        print(f"\nBERT's init for Q/K (std 0.02: near-uniform attention), P alone compressed: top-10% "
              f"global rel {flat_err['global_rel']:.2e} (min cos {flat_err['min_cos']:.4f}); int8 "
              f"{flat_int8['global_rel']:.2e} (min cos {flat_int8['min_cos']:.4f})")
        del flat

    dev = device_name()
    rows = []
    for r in results:
        e = r["err"] or {}
        rows.append({
            "device": dev, "torch": torch.__version__, "slimfit": slimfit.__version__,
            "backend": backend_info()["cpu"], "layers": args.layers, "batch": b, "seq": s,
            "config": r["config"],
            "saved_bytes_per_sample": round(r["run"].total / b),
            "saved_mib_per_sample": round(r["run"].total / b / MiB, 3),
            "reduction_vs_plain": round(base / r["run"].total, 3) if r["run"].total else "",
            "step_ms_median": round(1000 * r["time"], 1) if r["time"] is not None else "",
            "grad_global_rel_err": f"{e['global_rel']:.3e}" if e else "",
            "grad_median_rel_err": f"{e['median_rel']:.3e}" if e else "",
            "grad_max_rel_err": f"{e['max_rel']:.3e}" if e else "",
            "grad_min_cos": f"{e['min_cos']:.5f}" if e else "",
        })
    for label, e in ablation:
        rows.append({**{k: "" for k in rows[0]}, "device": dev, "torch": torch.__version__,
                     "slimfit": slimfit.__version__, "backend": backend_info()["cpu"],
                     "layers": args.layers, "batch": b,
                     "seq": s, "config": f"gradient ablation: {label} only",
                     "grad_global_rel_err": f"{e['global_rel']:.3e}",
                     "grad_median_rel_err": f"{e['median_rel']:.3e}",
                     "grad_max_rel_err": f"{e['max_rel']:.3e}", "grad_min_cos": f"{e['min_cos']:.5f}"})
    write_csv(args.csv, rows)
    shown = os.path.relpath(args.csv, _results.ROOT)
    print(f"\nwrote {args.csv if shown.startswith('..') else shown}")
    ratio = base / results[main_i]["run"].total  # the configuration
    print(f"target >= 8x fewer saved bytes than plain: {'met' if ratio >= 8 else 'NOT met'} ({ratio:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
