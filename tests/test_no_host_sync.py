"""A training step of a patched model never waits for the host (issue 16).

A GPU stalls whenever the host reads a value computed on it (`.item()`, `bool(t)`, `.tolist()`,
`.cpu()`) or copies a host scalar to it (`torch.tensor(v, device=x.device)`). Without a GPU the
same calls are visible on the CPU:

* a TorchDispatchMode marks every tensor computed from the model's parameters or inputs and
  counts `aten._local_scalar_dense` (what `.item()`, `bool()`, `float()` dispatch to) on them;
* `Tensor.tolist/.cpu/.numpy` on such a tensor count as device-to-host reads;
* `torch.tensor` / `torch.as_tensor` of host data with an explicit `device=` count as
  host-to-device copies (on a GPU that device is the GPU; a CPU 0-dim tensor without a device
  is read by the kernel launch and costs nothing).

Seeds drawn from torch's CPU generator are host values and are not counted. On a GPU the same
step also runs under `torch.cuda.set_sync_debug_mode("error")`.

The inputs carry no padding mask and Llama runs with use_cache=False: transformers itself reads
`padding_mask.all()` on the host when preparing an SDPA mask and copies the cache position with
torch.tensor(..., device=) (its own syncs, present without slimfit too).
"""
from __future__ import annotations

import collections
import traceback

import pytest
import torch
from patching.tiny_models import build
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

import slimfit
from slimfit import SlimFitConfig
from slimfit.kernels import _ops, reference

transformers = pytest.importorskip("transformers")

PRESETS = ["exact", "paper", "aggressive", "wta_crs"]

# Host reads inside branches that run on the CPU only (`if x.device.type == "cpu"`), where reading
# a value costs no device synchronisation; on a GPU they are skipped. (file suffix, function)
CPU_ONLY_READS = {
    ("slimfit/autograd/linear_cross_entropy.py", "_check_labels"),         # label range check
    ("slimfit/autograd/linear_cross_entropy.py", "linear_cross_entropy"),  # skip ignored rows' GEMMs
}


def _frame():
    """The innermost frame in slimfit or transformers (what to fix)."""
    frames = [f for f in traceback.extract_stack()[:-2] if "/slimfit/" in f.filename or "/transformers/" in f.filename]
    return frames[-1] if frames else traceback.extract_stack()[-3]


def _where() -> str:
    f = _frame()
    return f"{f.filename.split('/site-packages/')[-1]}:{f.lineno} in {f.name}"


def _cpu_only(f) -> bool:
    return any(f.filename.endswith(path) and f.name == fn for path, fn in CPU_ONLY_READS)


# ops whose result is a Python value read from the tensor (`bool(t)` may reach the mode as
# is_nonzero, whose own item() then runs below it)
HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
              torch.ops.aten.item.default, torch.ops.aten.equal.default}


class HostSyncCounter(TorchDispatchMode):
    """Counts host reads of tensors derived from `roots`, and host-to-device scalar copies."""

    def __init__(self, roots, python_kernels: bool = False):
        super().__init__()
        # python_kernels: run slimfit's ops through their Python implementations (argument checks
        # + reference kernel) under this mode, as the Triton launchers run on a GPU, so a host
        # read inside a launcher's checks is seen (a C++ kernel's own work is invisible here).
        self.python_kernels = python_kernels
        self.derived = WeakTensorKeyDictionary()
        for r in roots:
            self.derived[r] = True
        self.hits: list[tuple[str, str]] = []
        self.ops: collections.Counter = collections.Counter()  # custom ops seen (slimfit::*)

    def is_derived(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.derived

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "slimfit":
            self.ops[func._schema.name] += 1
        hot = any(self.is_derived(a) for a in tree_leaves((args, kwargs)))
        if hot and func in HOST_READS and not _cpu_only(_frame()):
            self.hits.append(("host read (.item / bool / float)", _where()))
        if self.python_kernels and func.namespace == "slimfit":
            name = func._schema.name.split("::")[1]
            with self:
                out = _ops._checked(name, getattr(reference, name))(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if hot:
            for o in tree_leaves(out):
                if isinstance(o, torch.Tensor):
                    self.derived[o] = True
        return out


def _install_copy_probes(monkeypatch, counter: HostSyncCounter) -> None:
    def h2d(fn):
        def wrapper(data, *args, **kwargs):
            if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
                counter.hits.append((f"host-to-device torch.{fn.__name__}", _where()))
            return fn(data, *args, **kwargs)
        return wrapper

    def d2h(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            if counter.is_derived(self):
                counter.hits.append((f"device-to-host .{name}()", _where()))
            return original(self, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(torch, "tensor", h2d(torch.tensor))
    monkeypatch.setattr(torch, "as_tensor", h2d(torch.as_tensor))
    for name in ("tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, d2h(name))


def _model(family: str, config: SlimFitConfig, device: str):
    model, inputs = build(family)
    inputs.pop("attention_mask", None)  # transformers' own host read (see the module docstring)
    if family == "llama":
        inputs["use_cache"] = False
    slimfit.patch(model, config)
    model.to(device).train()
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return model, inputs


def _counted_step(monkeypatch, family, config, device="cpu", python_kernels=False) -> list:
    model, inputs = _model(family, config, device)
    with monkeypatch.context() as m:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        roots = list(model.parameters()) + [v for v in inputs.values() if isinstance(v, torch.Tensor)]
        counter = HostSyncCounter(roots, python_kernels=python_kernels)
        _install_copy_probes(m, counter)
        with counter:
            loss = model(**inputs).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return counter.hits


@pytest.mark.parametrize("kernels", ["native", "python"])
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_training_step_has_no_host_sync(monkeypatch, family, preset, kernels):
    hits = _counted_step(monkeypatch, family, SlimFitConfig.preset(preset), python_kernels=kernels == "python")
    assert hits == [], f"{len(hits)} host syncs in one {family} step with {preset}(): {sorted(set(hits))}"


@pytest.mark.parametrize("kernels", [
    "native",
    pytest.param("python", marks=pytest.mark.xfail(strict=True, reason=(
        "validation.op_topk_restore reads the indices on the host for CPU tensors (free there, a ValueError); "
        "on accelerators it asserts on the device (torch._assert_async), which this CPU run cannot show"))),
])
def test_frozen_layers_have_no_host_sync(monkeypatch, kernels):
    """paper() with frozen LayerNorm x̂ top-k pruned, a frozen last layer above a trainable one: its
    LayerNorms save x̂ top-k pruned and restore it in backward, its linears take the frozen fast path."""
    model, inputs = _model("bert", SlimFitConfig.paper().with_experimental(topk_norms="frozen"), "cpu")
    for name, p in model.named_parameters():
        if "layer.0." not in name and "classifier" not in name:
            p.requires_grad_(False)
    with monkeypatch.context() as m:
        roots = list(model.parameters()) + [v for v in inputs.values() if isinstance(v, torch.Tensor)]
        counter = HostSyncCounter(roots, python_kernels=kernels == "python")
        _install_copy_probes(m, counter)
        with counter:
            model(**inputs).loss.backward()
    assert counter.hits == []
    assert counter.ops["slimfit::topk_restore"] >= 2  # the frozen layer's LayerNorms did restore x̂


def test_the_counter_sees_host_syncs(monkeypatch):
    """Control: check_finite=True reads every compressed tensor's scale on the host; the counter
    must report those (else the zero above would prove nothing)."""
    hits = _counted_step(monkeypatch, "bert", SlimFitConfig.paper().replace(check_finite=True))
    assert len(hits) >= 4 and all("kernels/api.py" in where for _, where in hits), hits


def test_the_counter_sees_host_to_device_copies(monkeypatch):
    x = torch.randn(4, requires_grad=True)
    counter = HostSyncCounter([x])
    with monkeypatch.context() as m:
        _install_copy_probes(m, counter)
        with counter:
            y = x * torch.tensor(2.0, device=x.device)
            y.sum().tolist()
            y = x * torch.tensor(2.0)  # a CPU scalar: no copy
    kinds = [k for k, _ in counter.hits]
    assert kinds == ["host-to-device torch.tensor", "device-to-host .tolist()"], counter.hits


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_check_finite_catches_nan(family):
    """check_finite=True raises on a NaN activation, naming it; off (the default) the step runs and
    the NaN shows in the loss (never hidden)."""
    model, inputs = _model(family, SlimFitConfig.paper().replace(check_finite=True), "cpu")
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        emb[inputs["input_ids"][0, 0]] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        model(**inputs).loss.backward()
    model, inputs = _model(family, SlimFitConfig.paper(), "cpu")
    with torch.no_grad():
        model.get_input_embeddings().weight[inputs["input_ids"][0, 0]] = float("nan")
    loss = model(**inputs).loss
    loss.backward()
    assert loss.isnan()


def _cuda_syncs(model, inputs) -> int:
    """Synchronizing CUDA calls of one training step after a warm-up step (lazy inits may sync once), counted
    by torch.cuda.set_sync_debug_mode("warn") warnings."""
    import warnings

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(**inputs).loss.backward()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model(**inputs).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_cuda_step_under_sync_debug_mode(family):
    """slimfit adds no synchronizing call to a step: no more than the plain model's own (transformers reads
    a packed-sequence check of the position ids on the host when no mask is given, with or without slimfit)."""
    plain, inputs = build(family)
    inputs.pop("attention_mask", None)
    if family == "llama":
        inputs["use_cache"] = False
    plain.to("cuda").train()
    inputs = {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    baseline = _cuda_syncs(plain, inputs)
    model, inputs = _model(family, SlimFitConfig.paper(), "cuda")
    assert _cuda_syncs(model, inputs) <= baseline
