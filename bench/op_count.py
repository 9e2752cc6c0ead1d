#!/usr/bin/env python
"""Ops dispatched per patched layer, against plain PyTorch (issue 16, item 5).

    python -m bench.op_count                  # BERT layer + Llama decoder layer;
                                              # writes bench/results/op_count_cpu.{csv,md}
    python -m bench.op_count --before dc7ba56:bench/results/op_count_cpu_before.csv
                                              # the same, with the counts of another run beside each row:
                                              # a CSV file, or REV:PATH from git history (here commit
                                              # 9820f11's counts, before issue 16's op reductions)
    python -m bench.op_count --render-only    # the .md again from the .csv (header kept), nothing counted
    python -m bench.op_count --quick          # tiny shapes: a smoke check, writes nothing (unless --out is given)

What is counted: every op that reaches the Python dispatch key, i.e. what a
`torch.utils._python_dispatch.TorchDispatchMode` sees as `func` (aten ops after the CompositeImplicitAutograd
decompositions, and slimfit's own `slimfit::` ops, each one call whatever kernel serves it), in one forward and,
separately, one backward (`out.backward(g)` with a random g made outside the count) of:

  linear          every nn.Linear of the layer, each called alone on the input it got in the layer (summed)
  gelu            the FFN activation module (BERT)
  layernorm       the LayerNorm modules (BERT, 2)
  rmsnorm         the RMSNorm modules (Llama, 2)
  swiglu          the MLP's product act_fn(gate) * up (Llama); patched: slimfit.autograd.swiglu, as SwiGLUMixin calls it
  dropout         the nn.Dropout modules the layer calls (BERT, 2; the attention's own dropout is in the core)
  attention core  the attention function the model's attention module calls (transformers' attention registry:
                  eager_attention_forward, sdpa_attention_forward or slimfit's), on the Q/K/V it got
  layer           the whole layer (BertLayer / LlamaDecoderLayer) called alone; it also holds what no row above
                  has: head reshapes, residual adds, RoPE, the engine's gradient accumulation

Each module is called on a detached copy of the input it received during one real forward of a one-layer model
(tensors that required grad there require grad here), so a row is that module's forward and backward and nothing
else. Configurations (one fresh model each, seed 0, train mode, fp32, CPU):
  eager       plain PyTorch, attn_implementation="eager"
  sdpa        plain PyTorch, attn_implementation="sdpa" (the transformers default)
  paper       slimfit.patch(sdpa model, SlimFitConfig.paper())
  aggressive  slimfit.patch(sdpa model, SlimFitConfig.aggressive())
and per configuration the layer's weights frozen (requires_grad False: the scheduler's frozen set) or trainable.
The embeddings stay trainable, so the layer's input requires grad in both.

Columns: fwd / bwd / total ops; "ratio" = total / eager's total (the issue's target: at most 1.2x per patched
layer); allocated MiB = bytes of the fresh (non-view) outputs of every op, forward + backward (what the ops write,
a proxy for memory traffic and temporaries); saved MiB = bytes saved for backward (saved-tensor hooks, storages
counted once, parameter objects not counted: a view of one, as an eager linear saves its weight transposed,
counts with its storage; see saved_bytes_hooks).
Models and token ids: bench/_measure.py's build and inputs (the bare BertModel / LlamaModel of MODELS).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/op_count.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import collections
import contextlib
import dataclasses
import os
import sys
import warnings

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import slimfit
from bench import _measure, _results
from slimfit import architectures as archs
from slimfit.config import SlimFitConfig

MiB = 2 ** 20
CONFIGS = ("eager", "sdpa", "paper", "aggressive")
PATCHED = ("paper", "aggressive")
WEIGHTS = ("frozen", "trainable")
KINDS = ("linear", "gelu", "layernorm", "rmsnorm", "swiglu", "dropout", "attention core", "layer")
TARGET = 1.2

MODELS = {
    # name: (config class, config kwargs, batch, seq)
    "bert": ("BertConfig", dict(vocab_size=1000, hidden_size=768, num_hidden_layers=1, num_attention_heads=12,
                                intermediate_size=3072), 2, 128),
    "llama": ("LlamaConfig", dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                  num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5), 2, 128),
}
QUICK_MODELS = {
    "bert": ("BertConfig", dict(vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=128), 2, 16),
    "llama": ("LlamaConfig", dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5), 2, 16),
}


# ------------------------------------------------------------------ counting
class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched under it, and the bytes of their fresh (non-aliasing) outputs."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.alloc = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[_op_name(func)] += 1
        returns = func._schema.returns
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for i, o in enumerate(outs):
            aliased = i < len(returns) and returns[i].alias_info is not None
            if isinstance(o, torch.Tensor) and not aliased:
                self.alloc += o.numel() * o.element_size()
        return out


def _op_name(func) -> str:
    name = str(func)
    return name[:-len(".default")] if name.endswith(".default") else name


@contextlib.contextmanager
def saved_bytes_hooks(params: set):
    """Bytes autograd saves under it (storages once, parameter objects not counted): yields a one-item list.
    Not slimfit.memory's count (bench/_measure.saved_of): a view of a parameter (the transposed weight
    an eager linear saves) counts here with its whole storage, and the committed table holds this count."""
    seen: set = set()
    total = [0]

    def pack(t):
        if id(t) not in params and not isinstance(t, nn.Parameter):
            try:
                key = (t.untyped_storage().data_ptr(), t.device)
                size = t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):
                key, size = id(t), t.numel() * t.element_size()
            if key not in seen:
                seen.add(key)
                total[0] += size
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


@dataclasses.dataclass
class Cell:
    model: str
    weights: str
    kind: str
    config: str
    modules: int = 0
    fwd: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    bwd: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    alloc: int = 0
    saved: int = 0
    note: str = ""

    @property
    def n_fwd(self) -> int:
        return sum(self.fwd.values())

    @property
    def n_bwd(self) -> int:
        return sum(self.bwd.values())

    @property
    def total(self) -> int:
        return self.n_fwd + self.n_bwd


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return o
    raise TypeError(f"no tensor in the output ({type(out).__name__})")


def _fresh(obj):
    """A detached copy of a captured input (requires grad where the original did)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone().requires_grad_(obj.requires_grad)
    if isinstance(obj, tuple):
        return tuple(_fresh(o) for o in obj)
    if isinstance(obj, list):
        return [_fresh(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _fresh(v) for k, v in obj.items()}
    return obj


def count_call(fn, args, kwargs, cell: Cell, model: nn.Module) -> None:
    """Adds the ops of one forward and one backward of fn(*args, **kwargs) to `cell` (parameter gradients
    cleared first, so every call stores its gradients rather than adding to an earlier call's)."""
    args, kwargs = _fresh(args), _fresh(kwargs)
    params = {id(p) for p in model.parameters()}
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    fwd = OpCounter()
    with saved_bytes_hooks(params) as saved, fwd:
        out = _first_tensor(fn(*args, **kwargs))
    g = torch.randn_like(out)
    bwd = OpCounter()
    with bwd:
        out.backward(g)
    cell.modules += 1
    cell.fwd.update(fwd.ops)
    cell.bwd.update(bwd.ops)
    cell.alloc += fwd.alloc + bwd.alloc
    cell.saved += saved[0]


# ------------------------------------------------------------------ models
BASE_MODELS = {"BertConfig": (archs.TEXT_CLS, "BertModel"), "LlamaConfig": (archs.CAUSAL_LM, "LlamaModel")}


def architecture(model_name: str, models: dict) -> archs.Architecture:
    """The bare model (no task head) of a MODELS entry, for bench/_measure.py's build."""
    cls_name, kwargs, _, _ = models[model_name]
    task, model_class = BASE_MODELS[cls_name]
    return archs.Architecture(model_name, task, cls_name, model_class, dict(kwargs))


def build(model_name: str, config: str, models: dict):
    """(model, token ids): the one-layer model (seed 0, train mode), patched for `config`."""
    _, _, batch, seq = models[model_name]
    arch, model = _measure.build(architecture(model_name, models), attn="eager" if config == "eager" else "sdpa")
    if config in PATCHED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            slimfit.patch(model, SlimFitConfig.preset(config))
    # the ids alone: the layer's inputs as a bare forward makes them (no attention mask)
    return model, _measure.inputs(model, arch, batch, seq)["input_ids"]


def _kind(module: nn.Module) -> str | None:
    from slimfit.patching.modules import ORIGINAL_CLASS

    cls = vars(module).get(ORIGINAL_CLASS, type(module))
    name = cls.__name__
    if cls is nn.Linear:
        return "linear"
    if cls is nn.LayerNorm:
        return "layernorm"
    if cls is nn.Dropout:
        return "dropout"
    if "RMSNorm" in name:
        return "rmsnorm"
    if "GELU" in name or name == "GELUActivation":
        return "gelu"
    return None


def capture(model, ids):
    """One forward of the model; returns (layer, {module: (args, kwargs)}, attention calls, mlp products)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    layer = (model.encoder.layer if hasattr(model, "encoder") else model.layers)[0]
    calls: dict = {}
    handles = []

    def pre(module, args, kwargs):
        calls.setdefault(module, (args, kwargs))

    handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
    for m in layer.modules():
        if _kind(m) is not None:
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
    products = []
    mlp = getattr(layer, "mlp", None)
    if mlp is not None and hasattr(mlp, "gate_proj"):
        got = {}
        handles.append(mlp.gate_proj.register_forward_hook(lambda m, a, o: got.__setitem__("gate", o)))
        handles.append(mlp.up_proj.register_forward_hook(lambda m, a, o: got.__setitem__("up", o)))
        products.append((mlp, got))
    attention = []
    real = ALL_ATTENTION_FUNCTIONS.get_interface

    def get_interface(name, default):
        fn = real(name, default)

        def recording(*args, **kwargs):
            if not attention:
                attention.append((fn, args, kwargs))
            return fn(*args, **kwargs)

        return recording

    ALL_ATTENTION_FUNCTIONS.get_interface = get_interface  # an instance attribute shadows the method
    try:
        model(input_ids=ids, **({} if hasattr(model, "encoder") else {"use_cache": False}))
    finally:
        del ALL_ATTENTION_FUNCTIONS.get_interface
        for h in handles:
            h.remove()
    return layer, calls, attention, [(m, (got["gate"], got["up"])) for m, got in products]


def _swiglu_fn(mlp):
    from slimfit.autograd.silu import swiglu
    from slimfit.patching.modules import OPTIONS

    o = vars(mlp).get(OPTIONS)
    if o is None:  # plain PyTorch (or a preset that leaves the MLP alone)
        return lambda gate, up: mlp.act_fn(gate) * up
    return lambda gate, up: swiglu(gate, up, bits=o.bits, group_size=o.group_size, stochastic=o.stochastic,
                                   check_finite=o.check_finite)


def _attention_path(model) -> str:
    summary = getattr(model, "slimfit_summary", None)
    return "" if summary is None else str(summary.attention or "")


def measure(model_name: str, config: str, weights: str, models: dict) -> list[Cell]:
    model, ids = build(model_name, config, models)
    layer = (model.encoder.layer if hasattr(model, "encoder") else model.layers)[0]
    for p in layer.parameters():
        p.requires_grad_(weights == "trainable")
    layer, calls, attention, products = capture(model, ids)
    cells = {k: Cell(model_name, weights, k, config) for k in KINDS}
    for module, (args, kwargs) in calls.items():
        kind = "layer" if module is layer else _kind(module)
        count_call(module, args, kwargs, cells[kind], model)
    for fn, args, kwargs in attention:
        count_call(fn, args, kwargs, cells["attention core"], model)
    for mlp, (gate, up) in products:
        count_call(_swiglu_fn(mlp), (gate, up), {}, cells["swiglu"], model)
    core = cells["attention core"]
    if attention:
        name = getattr(attention[0][0], "__name__", "")
        if name.startswith("slimfit"):  # which of slimfit's two paths ran (docs/attention.md)
            fused = any("scaled_dot_product" in op for op in core.fwd)
            name += " (fused path)" if fused else " (materializing path)"
        core.note = name
    return [c for c in cells.values() if c.modules]


# ------------------------------------------------------------------ output
def _ops_str(c: collections.Counter) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(c.items()))


def _parse_ops(s: str) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for item in s.split():
        k, _, v = item.rpartition(":")
        out[k] += int(v)
    return out


CSV_FIELDS = ["commit", "model", "weights", "kind", "config", "modules", "fwd_ops", "bwd_ops", "total_ops",
              "ratio_eager", "alloc_bytes", "saved_bytes", "note", "fwd_detail", "bwd_detail"]


def read_csv(path: str) -> list[Cell]:
    return _cells(_results.read_rows(path))


def _cells(rows: list[dict]) -> list[Cell]:
    return [Cell(r["model"], r["weights"], r["kind"], r["config"], int(r["modules"]), _parse_ops(r["fwd_detail"]),
                 _parse_ops(r["bwd_detail"]), int(r["alloc_bytes"]), int(r["saved_bytes"]), r["note"])
            for r in rows]


def _index(cells):
    return {(c.model, c.weights, c.kind, c.config): c for c in cells}


def write_csv(cells, path: str, commit: str) -> None:
    idx = _index(cells)
    rows = []
    for c in cells:
        base = idx.get((c.model, c.weights, c.kind, "eager"))
        ratio = f"{c.total / base.total:.3f}" if base and base.total else ""
        rows.append([commit, c.model, c.weights, c.kind, c.config, c.modules, c.n_fwd, c.n_bwd, c.total, ratio,
                     c.alloc, c.saved, c.note, _ops_str(c.fwd), _ops_str(c.bwd)])
    _results.write_rows(path, rows, CSV_FIELDS)


def _ratio(a: Cell | None, b: Cell | None) -> str:
    if a is None or b is None or not b.total:
        return "-"
    return f"{a.total / b.total:.2f}x"


def _mib(n: int) -> str:
    return f"{n / MiB:.1f}"


def _diff(patched: collections.Counter, eager: collections.Counter) -> str:
    d = collections.Counter(patched)
    d.subtract(eager)
    more = [f"+{v} {k}" for k, v in sorted(d.items(), key=lambda kv: (-kv[1], kv[0])) if v > 0]
    less = [f"{v} {k}" for k, v in sorted(d.items(), key=lambda kv: (kv[1], kv[0])) if v < 0]
    return ", ".join(more + less) or "same ops"


# Why the ops left above eager's are there (printed for the kinds that stay above 1.0x eager).
REMAINS = {
    "gelu": "`slimfit.quantize` in forward and `slimfit.dequantize` in backward: the compression itself, one op each "
            "way. Folding the quantize into the GELU (or the dequantize into gelu_backward) needs a fused kernel; "
            "backward writes gelu_backward's result over the dequantized buffer (`gelu_backward.grad_input`), so it "
            "allocates no second full-size fp32 tensor.",
    "layernorm": "Forward: x̂ is normalized once (`native_layer_norm` without affine) and, on the CPU in fp32 with "
                 "weight and bias, the output is `addcmul(bias, x̂, weight)`, bit for bit F.layer_norm's; elsewhere "
                 "(half dtypes, CUDA: not shown to be bit-exact) the output still comes from F.layer_norm, one more "
                 "normalizing pass. Then one compression op (`topk_prune` / `quantize`). Backward: the restore op and "
                 "the formula from x̂ and rstd, op for op (gw = g*w, two means, four elementwise ops: 8 ops where "
                 "eager's `native_layer_norm_backward` is 1; that kernel wants x and mean, which are not kept). "
                 "Fewer ops need a fused backward kernel, or `native_layer_norm_backward` fed (x̂, mean 0, rstd 1) "
                 "and one multiply by rstd: the same math in another rounding order, i.e. different gradient bits, "
                 "which this change was not to touch.",
    "rmsnorm": "below eager: the backward formula from x̂ and rstd has fewer ops than autograd's chain of "
               "pow/mean/rsqrt backward ops.",
    "swiglu": "two `slimfit.quantize` (gate and up) in forward, two `slimfit.dequantize` and the recomputed "
              "`silu(gate~)` in backward: the compression and the recompute that replaces the three saved tensors.",
    "attention core": "slimfit's attention (slimfit/autograd/attention.py, fused_attention.py) is being rewritten by "
                      "another engineer and was left alone here: its counts are reported as they are at this commit.",
    "linear": "below eager: the frozen path skips the weight-gradient GEMM and its transposes.",
    "dropout": "below eager: one seeded kernel each way instead of bernoulli_ + div_ + mul (the seed: one randint).",
}


def _summary(cells, before):
    """Rows of the whole-layer table: (model, weights, cfg, cell, eager, sdpa, before cell, before eager)."""
    idx = _index(cells)
    old = _index(before) if before else {}
    for model in dict.fromkeys(c.model for c in cells):
        for weights in WEIGHTS:
            e, sd = idx.get((model, weights, "layer", "eager")), idx.get((model, weights, "layer", "sdpa"))
            for cfg in PATCHED:
                c = idx.get((model, weights, "layer", cfg))
                if c is None or e is None:
                    continue
                yield (model, weights, cfg, c, e, sd, old.get((model, weights, "layer", cfg)),
                       old.get((model, weights, "layer", "eager")))


def _without_core(cells, model, weights, cfg) -> float | None:
    """The layer's ratio to eager with eager's attention core in place of the patched one."""
    idx = _index(cells)
    c, e = idx.get((model, weights, "layer", cfg)), idx.get((model, weights, "layer", "eager"))
    ac, ae = idx.get((model, weights, "attention core", cfg)), idx.get((model, weights, "attention core", "eager"))
    if None in (c, e, ac, ae) or not e.total:
        return None
    return (c.total - ac.total + ae.total) / e.total


def render_md(cells, header, before=None) -> str:
    lines = list(header) + _whole_layer(cells, before)
    for model in dict.fromkeys(c.model for c in cells):
        for weights in WEIGHTS:
            lines += _kind_table(cells, before, model, weights)
    lines += _above_eager(cells) + _ops_beyond_eager(cells)
    return "\n".join(lines).rstrip() + "\n"


def _whole_layer(cells, before) -> list[str]:
    """The whole-layer table (one row per model, weights, patched preset) and the targets missed."""
    idx = _index(cells)
    head = ["model", "layer weights", "preset", "eager", "sdpa", "patched: fwd / bwd = total",
            "ratio to eager (to sdpa)", f"target <= {TARGET}x", "ratio with eager's attention core"]
    body, missed = [], []
    for model, weights, cfg, c, e, sd, ob, oe in _summary(cells, before):
        r = c.total / e.total
        wc = _without_core(cells, model, weights, cfg)
        row = [model, weights, cfg, e.total, sd.total if sd else "-", f"{c.n_fwd} / {c.n_bwd} = **{c.total}**",
               f"**{r:.2f}x** ({_ratio(c, sd)})", "met" if r <= TARGET + 1e-9 else "NO",
               "-" if wc is None else f"{wc:.2f}x"]
        if before:
            row.append("-" if ob is None else f"{ob.total} ({_ratio(ob, oe or e)})")
        body.append(row)
        if c.total > TARGET * e.total + 1e-9:
            ac = idx.get((model, weights, "attention core", cfg))
            ae = idx.get((model, weights, "attention core", "eager"))
            core = f"; its attention core alone has {ac.total - ae.total:+d} ops over eager's" if ac and ae else ""
            missed.append(f"{model} {weights} {cfg}: {c.total - int(TARGET * e.total)} ops above the target "
                          f"({int(TARGET * e.total)}){core}")
    lines = ["", "## Whole layer", ""] + _results.md_table(head + (["before: total (ratio)"] if before else []), body)
    if missed:
        lines += ["", "Target missed: " + "; ".join(missed) + "."]
    return lines


def _kind_table(cells, before, model: str, weights: str) -> list[str]:
    """One model and weight setting: a row per module kind, every configuration side by side."""
    idx = _index(cells)
    old = _index(before) if before else {}
    head = ["kind", "n", "eager fwd/bwd", "sdpa fwd/bwd", "paper fwd/bwd", "paper ratio", "aggressive fwd/bwd",
            "aggressive ratio", "alloc MiB eager / paper / aggr.", "saved MiB eager / paper / aggr."]
    if before:
        head.append("before: paper / aggr. total (ratio), alloc MiB")

    def fb(c):
        return "-" if c is None else f"{c.n_fwd} / {c.n_bwd} = {c.total}"

    body = []
    for kind in KINDS:
        row = {cfg: idx.get((model, weights, kind, cfg)) for cfg in CONFIGS}
        e = row["eager"]
        if e is None:
            continue
        ratios = {}
        for cfg in PATCHED:
            r = _ratio(row[cfg], e)
            if kind in ("attention core", "layer") and row["sdpa"] is not None:
                r += f" ({_ratio(row[cfg], row['sdpa'])} sdpa)"
            ratios[cfg] = f"**{r}**" if kind == "layer" else r
        alloc = " / ".join("-" if row[c] is None else _mib(row[c].alloc) for c in ("eager", "paper", "aggressive"))
        saved = " / ".join("-" if row[c] is None else _mib(row[c].saved) for c in ("eager", "paper", "aggressive"))
        cells_ = [f"**{kind}**" if kind == "layer" else kind, e.modules, fb(e), fb(row["sdpa"]), fb(row["paper"]),
                  ratios["paper"], fb(row["aggressive"]), ratios["aggressive"], alloc, saved]
        if before:
            ob = {cfg: old.get((model, weights, kind, cfg)) for cfg in CONFIGS}
            cells_.append(" / ".join("-" if ob[cfg] is None else
                                     f"{ob[cfg].total} ({_ratio(ob[cfg], ob['eager'] or e)}), {_mib(ob[cfg].alloc)}"
                                     for cfg in PATCHED))
        body.append(cells_)
    lines = ["", f"## {model}, layer weights {weights}", ""] + _results.md_table(head, body)
    notes = {c.config: c.note for c in cells
             if c.model == model and c.weights == weights and c.kind == "attention core" and c.note}
    if notes:
        lines += ["", "Attention function: " + "; ".join(f"{k}: `{v}`" for k, v in notes.items()) + "."]
    return lines


def _above_eager(cells) -> list[str]:
    """The kinds a patched configuration leaves above eager's count, with the reason (REMAINS)."""
    idx = _index(cells)
    above = [k for k in KINDS if k != "layer" and any(
        c.kind == k and c.config in PATCHED and (e := idx.get((c.model, c.weights, k, "eager"))) and c.total > e.total
        for c in cells)]
    if not above:
        return []
    return ["", "## What stays above eager, and why", ""] + [f"- **{k}**: {REMAINS.get(k, '')}" for k in above]


def _ops_beyond_eager(cells) -> list[str]:
    idx = _index(cells)
    lines = ["", "## Ops beyond eager's, per kind (forward + backward; + more, - fewer than eager)", ""]
    for model in dict.fromkeys(c.model for c in cells):
        for weights in WEIGHTS:
            for cfg in PATCHED:
                lines += [f"### {model}, {weights}, {cfg}", ""]
                for kind in KINDS:
                    c, e = idx.get((model, weights, kind, cfg)), idx.get((model, weights, kind, "eager"))
                    if c is None or e is None:
                        continue
                    lines.append(f"- {kind} ({c.total} vs {e.total}): {_diff(c.fwd + c.bwd, e.fwd + e.bwd)}")
                lines.append("")
    return lines


def run(models: dict, names) -> list[Cell]:
    cells: list[Cell] = []
    for name in names:
        for weights in WEIGHTS:
            for config in CONFIGS:
                got = measure(name, config, weights, models)
                for c in got:
                    print(f"{c.model:6s} {c.weights:9s} {c.config:10s} {c.kind:15s} n={c.modules} "
                          f"fwd {c.n_fwd:4d} bwd {c.n_bwd:4d} total {c.total:4d}", flush=True)
                cells += got
    return cells


BEFORE_NOTE = "'before' columns:"


def _before_paragraph(source: str, rows: list[dict]) -> list[str]:
    then = next(iter(rows), {}).get("commit", "?")
    where = os.path.relpath(source, _results.ROOT) if os.path.exists(source) else source
    return ["", f"{BEFORE_NOTE} the counts of commit {then} ({where}), measured by this script."]


def _header(models: dict, names, argv, commit: str) -> list[str]:
    import transformers

    shapes = "; ".join(f"{n}: {models[n][0][:-6]}({', '.join(f'{k}={v}' for k, v in models[n][1].items())}), "
                       f"batch {models[n][2]}, seq {models[n][3]}" for n in names)
    return ["# Ops dispatched per patched layer, CPU (bench/op_count.py)", "",
            f"Command: `{_results.command('op_count', argv)}`", "",
            f"Commit: {commit}; {_results.now()}; torch {torch.__version__}, "
            f"transformers {transformers.__version__}, "
            f"slimfit CPU backend: {slimfit.kernels.backend_info()['cpu']}.", "",
            f"One layer, fp32, train mode, CPU. {shapes}. Counts: ops seen by a TorchDispatchMode (aten ops after "
            "CompositeImplicit decompositions, and `slimfit::` ops, one each) in one forward and one backward; "
            "each row's module called alone on a copy of the input it got in a real forward (see the script's "
            "docstring). ratio = total / eager's total; for the attention core and the layer also against "
            f"plain sdpa. Target (issue 16): at most {TARGET}x eager per patched layer. alloc = bytes of the "
            "fresh outputs of every op (fwd + bwd); saved = bytes kept for backward (parameters not counted)."]


def _kept_header(md_path: str, before: str | None) -> list[str]:
    """The header of the existing Markdown (the counting run's command, commit and versions), its Command
    naming this `--before` (or none) and its 'before' paragraph left out (this render adds its own)."""
    with open(md_path) as fh:
        lines = fh.read().split("\n## ", 1)[0].rstrip("\n").split("\n")
    kept = []
    for line in lines:
        if line.startswith(BEFORE_NOTE):
            if kept and kept[-1] == "":
                kept.pop()
            continue
        if line.startswith("Command: `") and line.endswith("`"):
            words = line[len("Command: `"):-1].split()
            while "--before" in words:
                i = words.index("--before")
                del words[i:i + 2]
            line = "Command: `" + " ".join(words + (["--before", before] if before else [])) + "`"
        kept.append(line)
    return kept


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--quick", action="store_true", help="tiny shapes; writes nothing unless --out is given")
    p.add_argument("--before", default=None, metavar="CSV",
                   help="the counts of another run beside each row: a CSV file, or REV:PATH of one in git history")
    p.add_argument("--render-only", action="store_true",
                   help="rebuild the Markdown from the CSV (header kept), count nothing")
    p.add_argument("--out", default=None, help=f"output folder (default {os.path.join('bench', 'results')})")
    p.add_argument("--commit", default=None, help="the commit label written with the results (default: git HEAD "
                   "of this tree, marked when slimfit/ has uncommitted changes)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    models = QUICK_MODELS if args.quick else MODELS
    commit = args.commit or _results.commit_label()
    csv_path = _results.results_path("op_count", "csv", "cpu", args.out)
    md_path = _results.results_path("op_count", "md", "cpu", args.out)
    before_rows = _results.read_compare_rows(args.before) if args.before else None
    if args.render_only:
        header = _kept_header(md_path, args.before)
    else:
        header = _header(models, args.models, argv, commit)
    if before_rows is not None:
        header += _before_paragraph(args.before, before_rows)
    cells = read_csv(csv_path) if args.render_only else run(models, args.models)
    md = render_md(cells, header, _cells(before_rows) if before_rows is not None else None)
    print()
    print(md)
    if args.render_only:
        _results.write_text(md_path, md)
        print(f"wrote {md_path}")
    elif args.out is not None or not args.quick:
        write_csv(cells, csv_path, commit)
        _results.write_text(md_path, md)
        print(f"wrote {csv_path} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
