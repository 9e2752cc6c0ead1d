"""Saved-activation accounting: how many bytes autograd keeps for backward, and who saved them.

    from slimfit.memory import measure, report
    run = measure(model, **batch)              # one forward + backward (batch with labels, or loss_fn=)
    run.total, run.per_module["encoder.0.ffn"]
    print(report(run, baseline=plain_run))     # table: module, bytes, share, vs baseline

Every tensor autograd saves goes through `torch.autograd.graph.saved_tensors_hooks`; the pack
hook attributes it to the innermost module running at that moment (forward pre/post hooks keep
a stack of module paths). Rules:
  * memory is counted per storage: a storage saved several times (the same tensor saved twice,
    views of one tensor) counts once, at its full size, for the module that saved it first;
  * parameters and buffers (of the measured module, of modules and nn.Parameters passed as
    arguments or reached through a plain function's closure / globals, and of anything given in
    `exclude=`) are not activations and are not counted (reported separately as `excluded`);
  * Python values kept on ctx (seeds, shapes) are not tensors and cost nothing here.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .loss import training_loss
from .units import format_bytes

__all__ = ["SavedMemory", "measure", "report", "saved_bytes"]

ROOT = "(root)"


@dataclasses.dataclass
class SavedMemory:
    """Bytes saved for backward during one forward."""

    total: int = 0
    per_module: dict[str, int] = dataclasses.field(default_factory=dict)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)  # distinct storages per module
    excluded: int = 0       # parameter / buffer bytes the hooks saw and did not count
    name: str = ""

    def __getitem__(self, module_path: str) -> int:
        return self.per_module.get(module_path, 0)

    def __str__(self) -> str:
        return report(self)


def _storage_key_and_bytes(t: torch.Tensor) -> tuple[Any, int]:
    try:
        st = t.untyped_storage()
        return (t.device.type, t.device.index, st.data_ptr()), int(st.nbytes())
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, exotic subclasses
        return ("id", id(t)), t.numel() * t.element_size()


def _walk(obj, depth: int = 0):
    """Tensors and modules inside (nested) containers."""
    if depth > 4:
        return
    if isinstance(obj, (torch.Tensor, nn.Module)):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from _walk(v, depth + 1)


def _referenced_objects(fn) -> list:
    """Modules / parameters a plain callable reaches through its closure or named globals
    (so `measure(lambda x: model(x), x)` does not count model's weights as activations)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:  # empty cell
            pass
    glb = getattr(fn, "__globals__", {}) or {}
    found += [glb[n] for n in code.co_names if n in glb]
    return [o for o in _walk(tuple(found)) if isinstance(o, (nn.Module, nn.Parameter))]


def _owned_tensors(objs) -> Iterable[torch.Tensor]:
    for obj in objs:
        if isinstance(obj, nn.Module):
            yield from obj.parameters()
            yield from obj.buffers()
        elif isinstance(obj, nn.Parameter):
            yield obj


_FIX = ("pass the labels so the model computes its own loss (its bytes counted), loss_fn=<output -> scalar "
        "loss> (e.g. loss_fn=lambda out: F.cross_entropy(out[0], target); it runs after the measured forward, "
        "its own bytes not counted), or backward=False to measure the forward alone")


def _refuse_meta(owners, args, kwargs) -> None:
    """Saved tensors on the meta device have no storage to tell apart, and the kernels that run there
    are not the ones a real device picks (SDPA's fused kernels, for one): no number would be true."""
    tensors = [t for t in _owned_tensors(owners)] + [t for t in _walk((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(t.device.type == "meta" for t in tensors):
        raise ValueError(
            "slimfit.memory.measure: the model or the inputs are on the meta device, where the saved bytes "
            "cannot be measured (meta tensors share no storage and the device's own kernels do not run). "
            "Measure on a real device with a small batch, e.g. model.to_empty(device='cpu') then "
            "initialise it (the bytes saved do not depend on the weights' values)."
        )


def _graph_leaves(loss: torch.Tensor) -> list:
    """The tensors whose `.grad` a `loss.backward()` would accumulate into (AccumulateGrad nodes)."""
    leaves, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _backward_leaving_no_grad(loss: torch.Tensor) -> None:
    """Run backward (the graph is checked and freed, backward-time side effects happen) without
    accumulating into any `.grad`: the gradients of the graph's leaves are computed and dropped."""
    leaves = _graph_leaves(loss)
    if leaves:
        torch.autograd.grad(loss, leaves, allow_unused=True)


def _parameter_keys(root, fn_or_module, args, kwargs, exclude) -> set:
    """Storage keys that are not activations: parameters and buffers of the measured module, of modules
    and nn.Parameters among the arguments or reached through a plain function's closure / globals, and
    everything in `exclude`. Refuses the meta device first (see `_refuse_meta`)."""
    owners = [root] if root is not None else []
    owners += [o for o in _walk((args, kwargs)) if isinstance(o, (nn.Module, nn.Parameter))]
    owners += _referenced_objects(fn_or_module)
    owners += list(_walk(tuple(exclude)))
    _refuse_meta(owners, args, kwargs)
    keys = {_storage_key_and_bytes(t)[0] for t in _owned_tensors(owners)}
    for t in _walk(tuple(exclude)):
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
            keys.add(_storage_key_and_bytes(t)[0])
    return keys


class _Counter:
    """The pack hook's state: each storage counted once, for the module on top of `stack` when first
    saved; parameter / buffer storages (`param_keys`) counted apart, as `excluded`."""

    def __init__(self, result: SavedMemory, param_keys: set):
        self.result, self.param_keys = result, param_keys
        self.stack = [ROOT]
        self.seen: dict[Any, int] = {}
        self.excluded_seen: set = set()
        self.keep_alive: list[torch.Tensor] = []  # so a freed storage's address cannot be reused mid-run

    def pack(self, t: torch.Tensor):
        key, nbytes = _storage_key_and_bytes(t)
        result = self.result
        if key in self.param_keys:
            if key not in self.excluded_seen:
                self.excluded_seen.add(key)
                result.excluded += nbytes
            return t
        if key not in self.seen:
            self.seen[key] = nbytes
            path = self.stack[-1]
            result.per_module[path] = result.per_module.get(path, 0) + nbytes
            result.counts[path] = result.counts.get(path, 0) + 1
            result.total += nbytes
            self.keep_alive.append(t)
        return t


def _path_hooks(root: nn.Module | None, stack: list) -> list:
    """Forward pre/post hooks on every module of root keeping `stack` (module paths) current, so the pack
    hook attributes a saved tensor to the innermost module running. Returns the handles to remove."""
    handles = []
    if root is None:
        return handles
    for name, mod in root.named_modules():
        path = name or ROOT

        def pre(_m, _a, path=path):
            stack.append(path)

        def post(_m, _a, _o):
            if len(stack) > 1:
                stack.pop()

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post, always_call=True))
    return handles


def measure(
    fn_or_module: Callable,
    *args,
    backward: bool = True,
    loss_fn: Callable | None = None,
    exclude: Iterable = (),
    **kwargs,
) -> SavedMemory:
    """Run `fn_or_module(*args, **kwargs)` once and count the bytes autograd saves for backward.

    backward: also run backward of the step's loss: `loss_fn(output)` if given, else `output.loss`
        (a Hugging Face model called with labels), else the output itself when it is a one-element
        tensor. This checks the graph is usable and frees it; no parameter's `.grad` is touched (the
        gradients are computed and dropped). `loss_fn` runs after the measured forward: the bytes it
        saves are not counted (a model given its labels computes its loss inside, counted). No loss
        is made up: an output without one (a tuple, a tensor of logits, `output.loss` None) raises
        ValueError naming the fix (labels, `loss_fn=`, or `backward=False`, an explicit measurement
        of the forward alone).
    exclude: extra modules / tensors whose storages are not activations. Parameters of the
        measured module, of modules / nn.Parameters among the arguments, and of those a plain
        function reaches through its closure or globals are excluded automatically.
    The keyword names `backward`, `loss_fn` and `exclude` are reserved; other keyword
    arguments go to the callable. A model or inputs on the meta device are refused (ValueError).
    """
    root = fn_or_module if isinstance(fn_or_module, nn.Module) else getattr(fn_or_module, "__self__", None)
    if not isinstance(root, nn.Module):
        root = None
    param_keys = _parameter_keys(root, fn_or_module, args, kwargs, exclude)

    counter = _Counter(SavedMemory(name=getattr(fn_or_module, "__name__", type(fn_or_module).__name__)),
                       param_keys)
    handles = _path_hooks(root, counter.stack)
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            out = fn_or_module(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    if backward:
        _backward_leaving_no_grad(training_loss(out, loss_fn, who="slimfit.memory.measure", fix=_FIX))
    del out
    counter.keep_alive.clear()
    return counter.result


def saved_bytes(fn: Callable, *args, **kwargs) -> int:
    """Total bytes autograd saves for backward in one forward of fn(*args, **kwargs)."""
    return measure(fn, *args, backward=False, **kwargs).total


def report(run: SavedMemory, baseline: SavedMemory | None = None) -> str:
    """A text table: module, bytes saved, share of the total, and (with a baseline) the
    baseline's bytes and the reduction factor baseline / run."""
    names = list(baseline.per_module) if baseline is not None else []
    names += [n for n in run.per_module if n not in names]
    header = ["module", "saved", "share"]
    if baseline is not None:
        header += ["baseline", "reduction"]
    rows = []

    def ratio(b: int, r: int) -> str:
        if r == 0:
            return "-" if b == 0 else "inf"
        return f"{b / r:.2f}x"

    for name in names:
        b = run.per_module.get(name, 0)
        row = [name, format_bytes(b), f"{100.0 * b / run.total:.1f}%" if run.total else "-"]
        if baseline is not None:
            bb = baseline.per_module.get(name, 0)
            row += [format_bytes(bb), ratio(bb, b)]
        rows.append(row)
    total = ["total", format_bytes(run.total), "100.0%" if run.total else "-"]
    if baseline is not None:
        total += [format_bytes(baseline.total), ratio(baseline.total, run.total)]
    widths = [max(len(str(r[i])) for r in [header, total] + rows) for i in range(len(header))]

    def line(cells):
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join([first] + rest)

    sep = "  ".join("-" * w for w in widths)
    out = [line(header), sep] + [line(r) for r in rows] + [sep, line(total)]
    if run.excluded or (baseline is not None and baseline.excluded):
        out.append(f"(parameters and buffers not counted: {format_bytes(run.excluded)})")
    return "\n".join(out)
