#!/usr/bin/env python
"""Ops dispatched by one whole steady-state training step, per phase, for plain PyTorch and slimfit.

    python -m bench.step_ops                  # BERT-base b2 s64, SmolLM2-135M shape b1 s128;
                                              # writes bench/results/step_ops_cpu.{csv,md}
    python -m bench.step_ops --quick          # bert-tiny and llama-tiny: a smoke check, writes nothing
                                              # (unless --out is given)
    python -m bench.step_ops --device fake-cuda   # the optimizer and scheduler phases on fake device tensors
                                                  # (their CUDA path); the default --device all runs both

Why: on a GPU every non-view op that reaches the dispatcher is about one kernel launch, and a step whose
kernels are short is bound by the host launching them. The launches are countable without a GPU: this script
counts them on the CPU, one training step split into its phases, so a change that adds launches shows here.

What is counted: every op a `torch.utils._python_dispatch.TorchDispatchMode` sees (bench/op_count.py's
OpCounter: aten ops after the CompositeImplicitAutograd decompositions, and slimfit's `slimfit::` ops, one each),
less what launches nothing: views (`func.is_view`: view, t, transpose, expand, ...) and `prim.` / `profiler.`
ops (a tensor subclass's `.device` query, the optimizer's record_function marks). The phase columns count the
rest, the launch proxy; what is left out is one column of its own ("views etc.", the whole step).

Phases of one step, as a training loop writes it:
  forward    loss = model(**batch).loss
  backward   loss.backward()
  optimizer  optimizer.step() and optimizer.zero_grad()
  scheduler  scheduler.step() (slimfit's rows: scores, the next frozen set)
The counted step is the third (COUNT_STEP): AdamW's state exists, the scheduler has scores and a frozen set.
Steps 1 and 2 run uncounted; fp32, train mode (dropout on), lr 1e-4, seed 0.

Rows (a fresh model each, random weights from slimfit.architectures, SDPA attention):
  plain              torch.optim.AdamW(foreach=True), as torch picks on CUDA
  checkpointing      plain + gradient checkpointing of every layer (the model's own enable call, its defaults)
  slimfit            slimfit.patch(model, SlimFitConfig.paper()), AdamW(foreach=True), ILSScheduler(model,
                     freeze_rate=0.7, optimizer=opt) with its defaults: every layer's AdamW moments held 8-bit,
                     the step taken by slimfit's chunked step
  slimfit-full-state the same with frozen_state=None: the AdamW state in full, torch's foreach step
Ratios are to the plain row of the same model: total, forward+backward, and the optimizer phase against plain's
foreach step. A foreach op counts as one op; CUDA's multi-tensor apply launches its kernel once per batch of
tensor chunks, a few times over a whole model's parameters, so against plain's foreach step the ratio
overstates the launch ratio by about that factor.

--device fake-cuda: the optimizer's and the scheduler's CUDA branches counted on the CPU. The model is built
and patched on the CPU, then its parameters are replaced by fake tensors (torch's FakeTensorMode, as `slimfit
plan` runs steps: slimfit/memory/plan/fake.py, its PlanMode answering host reads of fake data) on a stand-in
device, before the optimizer and the scheduler are built; every step's gradients are fake tensors for the
parameters that train (what backward gives them), and the optimizer and scheduler phases of all COUNT_STEP
steps run on them. The stand-in is `meta`, not `cuda`: a CPU-only torch build has no CUDA device guard, which
Python indexing of a CUDA tensor asks for (an error: the chunked step slices its pieces that way) and autograd's
gradient accumulation asks for (the process aborts). slimfit's optimizer and scheduler choose their device path
by `device.type != "cpu"` (slimfit/scheduler/scores.py, in_step.py, ils.py), so a meta tensor takes the path a
CUDA one takes, and torch's foreach AdamW keeps its step counters on the CPU for either. Ops that touch no
device tensor are counted apart ("host ops": those counters, the scheduler's bookkeeping). Not counted there:
the forward and backward (autograd, above; `slimfit plan --device cuda` runs its step on fake CPU tensors
too, so their ops are the CPU rows'); and the gradients carry no values, so the scheduler's scores read 0
and its frozen set is the tie-break's, of the same size as a real one.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/step_ops.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import collections
import contextlib
import dataclasses
import sys
import warnings

import torch

import slimfit
from bench import _results
from bench.op_count import OpCounter
from bench.op_count import _parse_ops as _parse_detail
from slimfit import architectures as archs
from slimfit.config import SlimFitConfig

MODELS = {"bert-base": (2, 64), "smollm2-135m": (1, 128)}     # name: (batch, seq)
QUICK_MODELS = {"bert-tiny": (2, 16), "llama-tiny": (1, 32)}
ROWS = ("plain", "checkpointing", "slimfit", "slimfit-full-state")
SLIMFIT_ROWS = ("slimfit", "slimfit-full-state")
PHASES = ("forward", "backward", "optimizer", "scheduler")
DEVICES = ("cpu", "fake-cuda")
COUNT_STEP = 3
LR = 1e-4
FREEZE_RATE = 0.7
TOP = 10
FAKE_DEVICE = "meta"   # the stand-in for CUDA in --device fake-cuda (module docstring)


# ------------------------------------------------------------------ counting
NOT_KERNELS = ("prim.", "profiler.")   # Python-level queries (a subclass's .device) and record_function marks


class PhaseCounter(OpCounter):
    """OpCounter (every op by name) that sorts out what launches no kernel: views, prim./profiler. ops and, with
    `device_only`, host ops (no tensor off the CPU among inputs and outputs: the scheduler's bookkeeping,
    AdamW's step counters, which stay on the CPU beside CUDA parameters)."""

    def __init__(self, device_only: bool = False):
        super().__init__()
        self.device_only = device_only
        self.other: set = set()                          # names of views and prim./profiler. ops
        self.host: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Count the op (OpCounter) and note which kind of non-launch it is, if any."""
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name = str(func).removesuffix(".default")
        if func.is_view or name.startswith(NOT_KERNELS):
            self.other.add(name)
        elif self.device_only and not _touches_device((args, kwargs, out)):
            self.host[name] += 1
        return out

    def launches(self) -> collections.Counter:
        """The ops that launch a kernel (on a GPU: one each), by name."""
        kept = collections.Counter({k: v for k, v in self.ops.items() if k not in self.other})
        kept.subtract(self.host)
        return +kept

    def non_kernel(self) -> int:
        """Views and prim./profiler. ops."""
        return sum(v for k, v in self.ops.items() if k in self.other)


def _touches_device(tree) -> bool:
    from torch.utils._pytree import tree_flatten

    return any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tree_flatten(tree)[0])


@dataclasses.dataclass
class Row:
    """One row: a model, a configuration, and per phase the non-view ops by name."""

    device: str
    model: str
    batch: int
    seq: int
    row: str
    ops: dict = dataclasses.field(default_factory=dict)      # phase: Counter of the ops that launch, by name
    views: int = 0                                           # views and prim./profiler. ops, every phase
    host: int = 0                                            # fake-cuda: ops on the CPU alone, every phase
    note: str = ""

    def n(self, phase: str) -> int | None:
        """The phase's op count; None for a phase not counted (fake-cuda's forward and backward)."""
        c = self.ops.get(phase)
        return None if c is None else sum(c.values())

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in self.ops.values())

    @property
    def fwd_bwd(self) -> int | None:
        f, b = self.n("forward"), self.n("backward")
        return None if f is None or b is None else f + b


class Phases:
    """A context per phase that counts it into a Row when counting is on (the counted step), else nothing."""

    def __init__(self, row: Row | None):
        self.row = row

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if self.row is None:
            yield
            return
        counter = PhaseCounter(device_only=self.row.device != "cpu")
        with counter:
            yield
        self.row.ops[phase] = counter.launches()
        self.row.views += counter.non_kernel()
        self.row.host += sum(counter.host.values())


# ------------------------------------------------------------------ the step
def _enable_checkpointing(model) -> None:
    """Gradient checkpointing of every layer with transformers' defaults (its current name, else the older)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable()
        else:
            model.gradient_checkpointing_enable()


def build_model(model_name: str, row: str, models: dict):
    """(model, batch) of one row: seed 0, fp32, train mode, SDPA; checkpointed or patched as the row says."""
    batch, seq = models[model_name]
    arch = archs.resolve(model_name)
    model = archs.build(arch, attn_implementation="sdpa", seed=0)
    inputs = archs.make_inputs(model, arch.task, batch, seq, seed=0)
    if row == "checkpointing":
        model.config.use_cache = False
        _enable_checkpointing(model)
    if row in SLIMFIT_ROWS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            slimfit.patch(model, SlimFitConfig.paper())
    return model, inputs


def build_optimizer(model, row: str):
    """(AdamW with foreach=True, ILSScheduler attached to it or None) of one row."""
    from slimfit.scheduler import ILSScheduler

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, foreach=True)
    scheduler = None
    if row in SLIMFIT_ROWS:
        options = {} if row == "slimfit" else {"frozen_state": None}
        # warmup_steps=0: the steady state's frozen set (a causal LM's default ramp trains every layer at first)
        scheduler = ILSScheduler(model, freeze_rate=FREEZE_RATE, optimizer=opt, warmup_steps=0, **options)
    return opt, scheduler


def train_step(model, inputs, opt, scheduler, phase) -> None:
    """One training step, each phase inside `phase(name)` (Phases)."""
    with phase("forward"):
        loss = model(**inputs).loss
    with phase("backward"):
        loss.backward()
    del loss
    with phase("optimizer"):
        opt.step()
        opt.zero_grad()
    if scheduler is not None:
        with phase("scheduler"):
            scheduler.step()


def count_cpu(model_name: str, row: str, models: dict) -> Row:
    """The ops of step COUNT_STEP of one row on the CPU."""
    batch, seq = models[model_name]
    out = Row("cpu", model_name, batch, seq, row)
    torch.manual_seed(0)
    model, inputs = build_model(model_name, row, models)
    opt, scheduler = build_optimizer(model, row)
    for step in range(1, COUNT_STEP + 1):
        train_step(model, inputs, opt, scheduler, Phases(out if step == COUNT_STEP else None))
    if scheduler is not None:
        scheduler.close()
    return out


# ------------------------------------------------------------------ fake CUDA
def _fake_cuda_mode():
    """slimfit plan's PlanMode (fake.py) with its factories left fake when they make CUDA tensors: PlanMode makes
    small factories real, which a CPU-only build cannot do on CUDA."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._pytree import tree_flatten

    fake_mod = _plan_fake()

    class FakeCudaPlanMode(fake_mod.PlanMode):
        def _run(self, func, args, kwargs):
            """Ops with tensor inputs as PlanMode runs them; factories fake, real when small and on the CPU."""
            if any(isinstance(a, torch.Tensor) for a in tree_flatten((args, kwargs))[0]):
                return super()._run(func, args, kwargs)
            out = func(*args, **kwargs)
            if fake_mod._small_fake(out) and all(t.device.type == "cpu" for t in tree_flatten(out)[0]):
                with unset_fake_temporarily():
                    out = func(*args, **kwargs)
            return out

    return FakeCudaPlanMode


def _plan_fake():
    """slimfit's fake-tensor module of the plan (slimfit/memory/plan/fake.py, or slimfit/plan/fake.py)."""
    import importlib

    for name in ("slimfit.memory.plan.fake", "slimfit.plan.fake"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("slimfit's plan fake-tensor module (slimfit/memory/plan/fake.py) is not there")


def _to_fake_cuda(model) -> None:
    """Every parameter of the model replaced by a fake CUDA parameter of the same shape (tied ones stay tied).
    Under a fake mode; before the optimizer and scheduler see the parameters."""
    new: dict = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in new:
                t = torch.empty(p.shape, dtype=p.dtype, device=FAKE_DEVICE)
                new[id(p)] = torch.nn.Parameter(t, p.requires_grad)
            module._parameters[name] = new[id(p)]


def count_fake_cuda(model_name: str, row: str, models: dict) -> Row:
    """The optimizer and scheduler ops of step COUNT_STEP of one row with fake CUDA parameters, gradients and
    state: the model built and patched on the CPU, its parameters then made fake CUDA; each step's gradients
    are fake tensors for the parameters that train (what backward gives them), no forward or backward."""
    batch, seq = models[model_name]
    out = Row("fake-cuda", model_name, batch, seq, row, note="forward and backward not run (module docstring)")
    torch.manual_seed(0)
    model, _ = build_model(model_name, row, models)
    fake = _plan_fake().new_fake_mode()
    with torch.random.fork_rng(devices=[]):
        with fake, _fake_cuda_mode()(fake_mode=fake):
            _to_fake_cuda(model)
        opt, scheduler = build_optimizer(model, row)   # outside the modes: the scheduler's bookkeeping is real
        for step in range(1, COUNT_STEP + 1):
            phase = Phases(out if step == COUNT_STEP else None)
            with fake, _fake_cuda_mode()(numbers=True, fake_mode=fake):
                for p in model.parameters():
                    if p.requires_grad:
                        p.grad = torch.empty_like(p)
                with phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
                if scheduler is not None:
                    with phase("scheduler"):
                        scheduler.step()
        if scheduler is not None:
            scheduler.close()
    return out


# ------------------------------------------------------------------ runs and output
def run(models: dict, devices=DEVICES, rows=ROWS) -> list[Row]:
    """Every row of every model on every device, printed as it is counted."""
    counters = {"cpu": count_cpu, "fake-cuda": count_fake_cuda}
    out = []
    for device in devices:
        for model_name in models:
            for row in rows:
                if device != "cpu" and row == "checkpointing":
                    continue   # its optimizer and scheduler are plain's; its forward and backward are not run there
                r = counters[device](model_name, row, models)
                phases = " ".join(f"{p} {_fmt(r.n(p))}" for p in PHASES)
                print(f"{device:9s} {model_name:13s} {row:18s} {phases} total {r.total}", flush=True)
                out.append(r)
    return out


def _fmt(n) -> str:
    return "-" if n is None else f"{n:,}"


def _ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def ratios(r: Row, plain: Row | None) -> dict:
    """Ratios to the plain row of the same device and model: total and forward+backward (on the CPU only,
    where every phase is counted), the optimizer phase against plain's foreach step."""
    if plain is None:
        return {"total": "-", "fwd_bwd": "-", "optimizer": "-"}
    cpu = r.device == "cpu"
    return {"total": _ratio(r.total, plain.total) if cpu else "-",
            "fwd_bwd": _ratio(r.fwd_bwd, plain.fwd_bwd) if cpu else "-",
            "optimizer": _ratio(r.n("optimizer"), plain.n("optimizer"))}


def _plain_of(rows: list[Row]) -> dict:
    return {(r.device, r.model): r for r in rows if r.row == "plain"}


def _detail(c) -> str:
    return "" if c is None else " ".join(f"{k}:{v}" for k, v in sorted(c.items()))


CSV_FIELDS = ["commit", "device", "model", "batch", "seq", "row", *PHASES, "total", "ratio_total", "ratio_fwd_bwd",
              "ratio_optimizer", "views", "host_ops", "note", *(f"{p}_detail" for p in PHASES)]


def csv_rows(rows: list[Row], commit: str) -> list[dict]:
    """The rows as CSV dicts (CSV_FIELDS); a phase not counted is empty."""
    plain = _plain_of(rows)
    out = []
    for r in rows:
        rat = ratios(r, plain.get((r.device, r.model)))
        d = dict(commit=commit, device=r.device, model=r.model, batch=r.batch, seq=r.seq, row=r.row, total=r.total,
                 ratio_total=rat["total"], ratio_fwd_bwd=rat["fwd_bwd"], ratio_optimizer=rat["optimizer"],
                 views=r.views, host_ops=r.host if r.device != "cpu" else "", note=r.note)
        for p in PHASES:
            d[p] = "" if r.n(p) is None else r.n(p)
            d[f"{p}_detail"] = _detail(r.ops.get(p))
        out.append(d)
    return out


def from_csv(path: str) -> list[Row]:
    """The rows of a CSV this script wrote."""
    rows = []
    for d in _results.read_rows(path):
        r = Row(d["device"], d["model"], int(d["batch"]), int(d["seq"]), d["row"], views=int(d["views"]),
                host=int(d["host_ops"] or 0), note=d["note"])
        r.ops = {p: _parse_detail(d[f"{p}_detail"]) for p in PHASES if d[p] != ""}
        rows.append(r)
    return rows


def _table(rows: list[Row]) -> list[str]:
    plain = _plain_of(rows)
    head = ["device", "model", "row", *PHASES, "total", "total / plain", "fwd+bwd / plain",
            "optimizer / plain's foreach step", "views etc.", "host ops"]
    body = []
    for r in rows:
        rat = ratios(r, plain.get((r.device, r.model)))
        body.append([r.device, f"{r.model} b{r.batch} s{r.seq}", r.row, *(_fmt(r.n(p)) for p in PHASES),
                     f"**{r.total:,}**", rat["total"], rat["fwd_bwd"], rat["optimizer"], f"{r.views:,}",
                     _fmt(r.host) if r.device != "cpu" else "-"])
    return _results.md_table(head, body, right=set(range(3, len(head))))


def _top_ops(rows: list[Row]) -> list[str]:
    """The TOP op names of slimfit's optimizer phase per device and model, beside plain's count of each."""
    plain = _plain_of(rows)
    lines = []
    for r in rows:
        if r.row != "slimfit" or "optimizer" not in r.ops:
            continue
        base = plain.get((r.device, r.model))
        base_ops = base.ops.get("optimizer", collections.Counter()) if base else collections.Counter()
        top = sorted(r.ops["optimizer"].items(), key=lambda kv: (-kv[1], kv[0]))[:TOP]   # ties by name
        lines += ["", f"### {r.device}, {r.model} b{r.batch} s{r.seq}: slimfit's optimizer step "
                      f"({r.n('optimizer'):,} ops; the top {TOP} hold {sum(v for _, v in top):,})", ""]
        lines += _results.md_table(["op", "slimfit", "plain"], [[f"`{k}`", f"{v:,}", f"{base_ops.get(k, 0):,}"]
                                                                 for k, v in top], right={1, 2})
    return lines


def render_md(rows: list[Row], header: list[str]) -> str:
    lines = list(header) + ["", "## Ops per phase of one steady-state step", ""] + _table(rows)
    lines += ["", f"## Where the optimizer step's ops are (top {TOP} names)"] + _top_ops(rows)
    return "\n".join(lines).rstrip() + "\n"


def header(models: dict, devices, argv, commit: str) -> list[str]:
    """The Markdown header: the command, commit, date, versions, shapes and what is counted."""
    import transformers

    shapes = "; ".join(f"{name} batch {b} seq {s}" for name, (b, s) in models.items())
    lines = ["# Ops dispatched per training step, by phase (bench/step_ops.py)", "",
             f"Command: `{_results.command('step_ops', argv)}`", "",
             f"Commit: {commit}; {_results.now()}; torch {torch.__version__}, transformers {transformers.__version__}, "
             f"slimfit CPU backend: {slimfit.kernels.backend_info()['cpu']}.", "",
             f"Models (slimfit.architectures, random weights, SDPA): {shapes}. fp32, train mode, step {COUNT_STEP} "
             f"counted (steps 1-{COUNT_STEP - 1} uncounted: AdamW's state made, the scheduler scored). Rows: plain = "
             "AdamW(foreach=True), as torch picks on CUDA; checkpointing = plain + the model's gradient "
             f"checkpointing; slimfit = `paper()` + ILSScheduler(freeze_rate={FREEZE_RATE}) with its defaults (every "
             "layer's AdamW moments 8-bit, slimfit's chunked step); slimfit-full-state = the same with "
             "frozen_state=None. Phases: forward, backward, optimizer = `step()` + `zero_grad()`, scheduler = "
             "`scheduler.step()`.", "",
             "Counted: the ops a TorchDispatchMode sees (aten ops after the CompositeImplicit decompositions, "
             "`slimfit::` ops, one each) that launch a kernel on a GPU: views and `prim.`/`profiler.` ops are left "
             "out of the phase columns and counted under 'views etc.'. On the CPU every other op counts, host-side "
             "ones too (AdamW's step counters, the scheduler's bookkeeping). A foreach op counts once; on CUDA its "
             "multi-tensor kernel is launched once per batch of tensor chunks, a few times for a whole model's "
             "parameters, so the ratios to plain's foreach step overstate the launches by about that factor."]
    if "fake-cuda" in devices:
        lines += ["", "fake-cuda rows: the optimizer and scheduler phases with the parameters, gradients and state "
                      f"fake tensors on a non-CPU device (`{FAKE_DEVICE}`: slimfit's optimizer and scheduler take "
                      "their CUDA branch for any device that is not the CPU), so the CUDA path's ops are counted; "
                      "ops that touch no device tensor are 'host ops', not launches. Forward and backward are not "
                      "run there (a CPU-only build cannot run autograd on fake CUDA tensors; the module docstring "
                      "says why), so total and forward+backward ratios are the CPU rows'. Gradients are fake, "
                      "so the scheduler's scores read as 0 (its frozen set is then the tie-break's)."]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="all", choices=("all", *DEVICES),
                   help="cpu, fake-cuda (the optimizer and scheduler on fake non-CPU tensors), or all (default)")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--quick", action="store_true", help="the small test architectures; writes nothing unless --out")
    p.add_argument("--out", default=None, help="output folder (default bench/results)")
    p.add_argument("--render-only", action="store_true", help="rebuild the Markdown from the CSV, count nothing")
    p.add_argument("--commit", default=None, help="the commit label written with the results (default: git HEAD)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    models = QUICK_MODELS if args.quick else MODELS
    devices = DEVICES if args.device == "all" else (args.device,)
    commit = args.commit or _results.commit_label()
    csv_path = _results.results_path("step_ops", "csv", "cpu", args.out)
    md_path = _results.results_path("step_ops", "md", "cpu", args.out)
    if args.render_only:
        with open(md_path) as fh:
            kept = fh.read().split("\n## ", 1)[0].rstrip("\n").split("\n")
        rows = from_csv(csv_path)
    else:
        kept = header(models, devices, argv, commit)
        rows = run(models, devices, args.rows)
    md = render_md(rows, kept)
    print()
    print(md)
    if args.render_only or args.out is not None or not args.quick:
        if not args.render_only:
            _results.write_rows(csv_path, csv_rows(rows, commit), CSV_FIELDS)
        _results.write_text(md_path, md)
        print(f"wrote {md_path}" + ("" if args.render_only else " and .csv"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
