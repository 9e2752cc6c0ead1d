#!/usr/bin/env python
"""Benchmark of the slimfit compression kernels: every op, every available backend, on
the CPU and (when there is one) the GPU, against the reference and against a plain
copy of the same number of bytes measured in the same run.

    python -m bench.kernels                      # full run; writes bench/results/kernels_<cpu|gpu>.{csv,md}
    python -m bench.kernels --device cuda        # only the GPU (keeps the committed CPU table)
    python -m bench.kernels --quick              # smoke test: small sizes, nothing written
    python -m bench.kernels --ops quantize,dequantize --numel 8M --dtype bf16

Backends
  CPU   reference  slimfit.kernels.reference.<op>, called directly
        native     torch.ops.slimfit.<op> on CPU tensors (the C++ kernels of slimfit._C),
                   only when backend_info()['cpu'] says native
  CUDA  reference  slimfit.kernels.reference.<op> on CUDA tensors
        cuda-ext / triton-op
                   torch.ops.slimfit.<op>: whichever kernel is registered for CUDA
        triton     slimfit.kernels.triton.<op>, the Triton launcher called directly

Columns
  ms       median time of one call (bench/_timing.py)
  GB/s     (bytes the op must read + bytes it must write) / ms, counting packed codes,
           scales, offsets, block maxima, code maps, indices and bool masks (1 byte per element) exactly
  % copy   GB/s relative to `dst.copy_(src)` of a uint8 buffer of (read + written) / 2
           bytes, i.e. the same traffic, measured right before each case
  vs ref   reference ms / this backend's ms
  match    the backend's output equals the reference output (on CPU copies) bit for bit ("ok"), or not
           ("DIFF"); the reference is the specification, so DIFF is a bug to look at
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/kernels.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import dataclasses
import importlib
import math
import os
import sys
from dataclasses import dataclass, fields
from typing import Callable

import torch

from bench import _results, _timing
from slimfit.kernels import backend_info, reference
from slimfit.kernels.validation import num_groups, packed_code_bytes, topk_index_dtype

OPS = (
    "quantize", "dequantize", "topk_prune", "topk_restore",
    "pack_bits", "unpack_bits", "dropout_mask", "seeded_dropout",
    "quantize_blockwise", "dequantize_blockwise", "round_stochastic",
)
MASK_OPS = ("pack_bits", "unpack_bits", "dropout_mask")  # no float input: measured once, dtype "bool"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BITS = (2, 4, 8)
GROUP_SIZE = 128
BLOCKWISE = ((8, "signed"), (4, "signed"), (8, "unsigned"))  # the codec's maps: first moments, second moments
TOPK_ROWS = (128, 197, 512, 768, 2048)  # P rows (seq 128 / ViT-B/16 197 / 512 / decoder 2048), LayerNorm rows (768)
TOPK_KEEP = 0.10
DROPOUT_P = 0.1
SEED = 12345
DEFAULT_NUMEL = {"cuda": 32 << 20, "cpu": 4 << 20}
QUICK_NUMEL = 1 << 16
RESULTS_DIR = _results.RESULTS_DIR  # where a full run writes by default

TARGETS_TEXT = {
    "cpu": "C++ kernels at least 3x faster than the reference.",
    "cuda": "On an H100 at 32M elements: quantize and dequantize at least 80% of the copy "
            "bandwidth, top-k (prune and restore) at least 50%.",
}


# ------------------------------------------------------------------ cases
@dataclass
class Case:
    op: str
    config: str
    dtype: str
    numel: int
    args: tuple
    bytes_read: int
    bytes_written: int

    @property
    def nbytes(self) -> int:
        return self.bytes_read + self.bytes_written


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def build_cases(ops, numel: int, dtypes, device) -> list[Case]:
    """Inputs for every (op, config, dtype). Derived inputs (codes to dequantize, pruned
    rows to restore, packed masks) come from the reference, so every backend gets the
    same valid data."""
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    torch.manual_seed(SEED)
    xs = {name: torch.randn(numel, device=gen_device, dtype=torch.float32).to(DTYPES[name])
          for name in dtypes}
    cases: list[Case] = []
    ng = num_groups(numel, GROUP_SIZE)
    for op in ops:
        if op in MASK_OPS:
            continue
        for name in dtypes:
            x, dt = xs[name], DTYPES[name]
            es = _elem(dt)
            if op == "quantize":
                for bits in BITS:
                    for stochastic in (False, True):
                        cases.append(Case(
                            op, f"{bits}-bit g{GROUP_SIZE} {'stochastic' if stochastic else 'nearest'}",
                            name, numel, (x, bits, GROUP_SIZE, stochastic, SEED),
                            numel * es, packed_code_bytes(numel, bits) + 2 * 4 * ng))
            elif op == "dequantize":
                for bits in BITS:
                    codes, scale, offset = reference.quantize(x, bits, GROUP_SIZE, False, 0)
                    cases.append(Case(
                        op, f"{bits}-bit g{GROUP_SIZE}", name, numel,
                        (codes, scale, offset, bits, GROUP_SIZE, [numel], dt),
                        codes.numel() + scale.numel() * 4 + offset.numel() * 4, numel * es))
            elif op in ("quantize_blockwise", "dequantize_blockwise"):
                cases += _blockwise_cases(op, name, x, numel, es)
            elif op in ("topk_prune", "topk_restore"):
                for row in TOPK_ROWS:
                    rows = numel // row
                    if rows == 0:
                        continue
                    k = max(1, math.ceil(TOPK_KEEP * row))
                    xr = x[: rows * row].view(rows, row)
                    kept = rows * k * (es + _elem(topk_index_dtype(row)))
                    if op == "topk_prune":
                        cases.append(Case(op, f"row {row} keep {k} |x|", name, rows * row,
                                          (xr, k, True), rows * row * es, kept))
                    else:
                        values, indices = reference.topk_prune(xr, k, True)
                        cases.append(Case(op, f"row {row} keep {k}", name, rows * row,
                                          (values, indices, row), kept, rows * row * es))
            elif op == "seeded_dropout":
                cases.append(Case(op, f"p={DROPOUT_P}", name, numel, (x, DROPOUT_P, SEED),
                                  numel * es, numel * es))
            elif op == "round_stochastic" and dt == torch.float32:   # fp32 in, a 16-bit float out
                for out in (torch.bfloat16, torch.float16):
                    cases.append(Case(op, f"to {str(out).split('.')[-1]}", name, numel, (x, out, SEED),
                                      numel * es, numel * 2))
    if any(op in MASK_OPS for op in ops):
        mask = torch.rand(numel, device=gen_device) < 0.5
        packed = reference.pack_bits(mask)
        for op in ops:
            if op == "pack_bits":
                cases.append(Case(op, "1 bit/element", "bool", numel, (mask,), numel, packed.numel()))
            elif op == "unpack_bits":
                cases.append(Case(op, "1 bit/element", "bool", numel, (packed, numel), packed.numel(), numel))
            elif op == "dropout_mask":
                # `like` only gives the shape: nothing is read, one bool per element is written.
                cases.append(Case(op, f"p={DROPOUT_P}", "bool", numel, (mask, DROPOUT_P, SEED), 0, numel))
    return [_to_device(c, device) for c in cases]


def _blockwise_cases(op: str, name: str, x, numel: int, es: int) -> list[Case]:
    """Block-wise dynamic quantization with the optimizer codec's maps (slimfit/kernels/qmaps.py), block
    GROUP_SIZE, rounded to nearest and stochastically (the codec's rounding; seed SEED); a second moment's
    input is non-negative (|x|). Bytes: the input (or the codes and one fp32 absmax per block) and the map
    read (stochastic: and its table of inverse gaps, as large), the codes and maxima (or the output) written."""
    from slimfit.kernels import qmaps

    out = []
    for bits, kind in BLOCKWISE:
        q = qmaps.MAPS[kind](bits).to(x.device)
        xs = x if kind == "signed" else x.abs()
        packed = packed_code_bytes(numel, bits) + 4 * num_groups(numel, GROUP_SIZE)
        config = f"{bits}-bit {kind} b{GROUP_SIZE}"
        if op == "quantize_blockwise":
            out.append(Case(op, config, name, numel, (xs, q, GROUP_SIZE), numel * es + q.numel() * 4, packed))
            out.append(Case(op, f"{config} stochastic", name, numel, (xs, q, GROUP_SIZE, True, SEED),
                            numel * es + q.numel() * 8, packed))
        else:
            codes, absmax = reference.quantize_blockwise(xs, q, GROUP_SIZE)
            out.append(Case(op, config, name, numel, (codes, absmax, q, GROUP_SIZE, [numel], x.dtype),
                            packed + q.numel() * 4, numel * es))
    return out


def _to_device(case: Case, device) -> Case:
    case.args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in case.args)
    return case


# ------------------------------------------------------------------ backends
def _registered(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"slimfit::{op}", key)


def backends_for(device) -> tuple[list[tuple[str, Callable[[str], tuple[str, Callable] | None]]], list[str]]:
    """[(label, resolve)], notes. resolve(op) -> (backend name, callable) or None."""
    info = backend_info()
    notes: list[str] = []
    out = [("reference", lambda op: ("reference", getattr(reference, op)))]
    if device.type == "cpu":
        if info["cpu"].startswith("native"):
            out.append(("native", lambda op: ("native", getattr(torch.ops.slimfit, op))
                        if _registered(op, "CPU") else None))
        else:
            notes.append("native C++ backend not measured: it is not loaded "
                         f"({info.get('native_error') or 'SLIMFIT_BACKEND=reference'}).")
        return out, notes

    ext_ops, triton_ops = set(info["cuda_extension_ops"]), set(info["cuda_triton_ops"])

    def registered(op):
        if op in ext_ops:
            return "cuda-ext", getattr(torch.ops.slimfit, op)
        if op in triton_ops:
            return "triton-op", getattr(torch.ops.slimfit, op)
        return None  # torch.ops.slimfit.<op> would fall back to the reference

    out.append(("registered", registered))
    if not ext_ops and not triton_ops:
        notes.append("no CUDA kernel is registered for any op "
                     f"(triton: {info.get('triton_error') or 'not registered'}).")
    try:
        tk = importlib.import_module("slimfit.kernels.triton")
    except Exception as exc:
        notes.append(f"direct Triton launchers not measured: slimfit.kernels.triton failed to import "
                     f"({type(exc).__name__}: {exc}).")
    else:
        out.append(("triton", lambda op: ("triton", getattr(tk, op)) if callable(getattr(tk, op, None)) else None))
    return out, notes


# ------------------------------------------------------------------ measuring
@dataclass
class Row:
    device: str
    device_name: str
    op: str
    backend: str
    config: str
    numel: int
    dtype: str
    ms: float | None
    gbps: float | None
    copy_gbps: float | None
    pct_copy: float | None
    speedup_vs_ref: float | None
    match: str
    bytes_read: int
    bytes_written: int
    timer: str
    reps: int
    threads: int
    loadavg: float | None
    torch: str
    triton: str
    cuda: str
    date: str
    error: str = ""


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return (a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
            and torch.equal(a, b))


def _cpu(out):
    return [_cpu(t) for t in out] if isinstance(out, (tuple, list)) else out.cpu()


def _specification(case, out):
    """The output every backend must equal bit for bit: the reference on CPU copies of the arguments
    (as the kernel tests compare). The reference run on CUDA tensors is only timed: PyTorch's own CUDA
    kernels may round a division or fuse a multiply-add differently from its CPU ones."""
    if out.device.type == "cpu" if isinstance(out, torch.Tensor) else all(t.device.type == "cpu" for t in out):
        return out
    args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in case.args]
    return getattr(reference, case.op)(*args)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_gbps(device, nbytes: int, settings: _timing.Settings) -> float:
    """GB/s of `dst.copy_(src)` moving `nbytes` in all (read + written). Measured again
    for every case, right before its backends, so that a change of load on a shared
    machine hits the op and its baseline alike."""
    half = max(1, (nbytes + 1) // 2)
    src = torch.full((half,), 7, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = _timing.bench(lambda: dst.copy_(src), device, settings)
    return 2 * half / (t.ms * 1e-3) / 1e9


def run_device(device, ops, numel: int, dtypes, settings: _timing.Settings, log=print) -> tuple[list[Row], list[str]]:
    vers = _results.versions()
    dev_name = _results.device_name(device)
    stamp = _results.now()
    backends, notes = backends_for(device)
    log(f"[{device.type}] {dev_name}: building inputs ({numel:,} elements)...")
    cases = build_cases(ops, numel, dtypes, device)
    # The first call of each backend is its warm-up (and gives the output compared).
    timed_settings = dataclasses.replace(settings, cpu_warmup=0)
    rows: list[Row] = []
    for case in cases:
        ref_out, ref_ms = None, None
        copy_bw = copy_gbps(device, case.nbytes, settings)
        load = _results.load_average()
        for _label, resolve in backends:
            got = resolve(case.op)
            if got is None:
                continue
            bname, fn = got
            args = case.args

            def call(fn=fn, args=args):
                return fn(*args)

            base = dict(device=device.type, device_name=dev_name, op=case.op, backend=bname,
                        config=case.config, numel=case.numel, dtype=case.dtype,
                        bytes_read=case.bytes_read, bytes_written=case.bytes_written,
                        threads=torch.get_num_threads(), loadavg=load, torch=vers["torch"], triton=vers["triton"],
                        cuda=vers["cuda"], date=stamp)
            try:
                out = call()
                _sync(device)
                if bname == "reference":
                    ref_out, match = _specification(case, out), "ref"
                else:
                    match = "?" if ref_out is None else ("ok" if _same(_cpu(out), ref_out) else "DIFF")
                del out
                t = _timing.bench(call, device, timed_settings)
            except Exception as exc:  # report and go on: one broken kernel must not hide the rest
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # after an out-of-memory error
                msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
                rows.append(Row(**base, ms=None, gbps=None, copy_gbps=copy_bw, pct_copy=None,
                                speedup_vs_ref=None, match="error", timer="", reps=0, error=msg))
                log(f"  {case.op:<15} {case.config:<26} {case.dtype:<5} {bname:<10} ERROR {msg}")
                continue
            if bname == "reference":
                ref_ms = t.ms
            gbps = case.nbytes / (t.ms * 1e-3) / 1e9
            row = Row(**base, ms=t.ms, gbps=gbps, copy_gbps=copy_bw, pct_copy=100.0 * gbps / copy_bw,
                      speedup_vs_ref=(ref_ms / t.ms) if ref_ms else None, match=match,
                      timer=t.method, reps=t.reps)
            rows.append(row)
            log(f"  {case.op:<15} {case.config:<26} {case.dtype:<5} {bname:<10} {t.ms:10.3f} ms "
                f"{gbps:8.2f} GB/s {row.pct_copy:6.1f}% copy  {_fmt_x(row.speedup_vs_ref):>8} {match}")
        del ref_out
    return rows, notes + _run_notes(backends, ops, rows)


def _run_notes(backends, ops, rows: list[Row]) -> list[str]:
    """Ops a backend has no kernel for, outputs that differ from the reference, failures."""
    notes = []
    missing: dict[str, list[str]] = {}
    for label, resolve in backends[1:]:
        for op in ops:
            if resolve(op) is None:
                missing.setdefault(label, []).append(op)
    for label, names in missing.items():
        notes.append(f"{label}: no kernel for {', '.join(names)} (not measured).")
    diff = [r for r in rows if r.match == "DIFF"]
    if diff:
        notes.append("output differs from the reference (a kernel bug, or a spec change): "
                     + "; ".join(f"{r.op} {r.config} {r.dtype} {r.backend}" for r in diff) + ".")
    notes += [f"{r.op} {r.config} {r.dtype} {r.backend} failed: {r.error}" for r in rows if r.error]
    return notes


# ------------------------------------------------------------------ reporting
COLUMNS = ("op", "backend", "config", "dtype", "ms", "GB/s", "% copy", "copy GB/s", "vs ref", "match")


def _fmt_x(v) -> str:
    return "" if v is None else f"{v:.2f}x"


def _cells(r: Row) -> list[str]:
    if r.error:
        return [r.op, r.backend, r.config, r.dtype, "error", "", "", f"{r.copy_gbps:.1f}", "", r.error]
    return [r.op, r.backend, r.config, r.dtype, f"{r.ms:.3f}", f"{r.gbps:.2f}", f"{r.pct_copy:.0f}%",
            f"{r.copy_gbps:.1f}", _fmt_x(r.speedup_vs_ref), r.match]


NUMERIC = (4, 5, 6, 7, 8)


def text_table(rows: list[Row]) -> str:
    return "\n".join(_results.text_table(COLUMNS, [_cells(r) for r in rows], right=NUMERIC))


def markdown_table(rows: list[Row]) -> str:
    return "\n".join(_results.md_table(COLUMNS, [_cells(r) for r in rows], right=NUMERIC))


def _below(items: list[str], limit: int = 8) -> list[str]:
    out = [f"  below target: {s}" for s in items[:limit]]
    if len(items) > limit:
        out.append(f"  below target: ... and {len(items) - limit} more (see the table)")
    return out


def check_targets(device, rows: list[Row], numel: int) -> list[str]:
    """Targets are stated, not asserted: one line each, saying met or not and by how much."""
    ok_rows = [r for r in rows if not r.error]
    if device.type == "cpu":
        native = [r for r in ok_rows if r.backend == "native" and r.speedup_vs_ref is not None]
        if not native:
            return ["C++ kernels >= 3x faster than the reference: not measured (native backend not available)."]
        low = min(native, key=lambda r: r.speedup_vs_ref)
        miss = [r for r in native if r.speedup_vs_ref < 3.0]
        line = (f"{'met' if not miss else 'NOT met'}: C++ kernels >= 3x faster than the reference in "
                f"{len(native) - len(miss)}/{len(native)} rows; lowest {low.speedup_vs_ref:.2f}x "
                f"({low.op} {low.config} {low.dtype}).")
        return [line] + _below([f"{r.op} {r.config} {r.dtype}: {r.speedup_vs_ref:.2f}x" for r in miss])
    out = []
    name = rows[0].device_name if rows else ""
    caveats = []
    if numel < (32 << 20):
        caveats.append(f"measured at {numel:,} elements, the target is stated at 32M")
    if "H100" not in name:
        caveats.append(f"the target is stated for an H100, this is {name or 'an unknown GPU'}")
    kernels = [r for r in ok_rows if r.backend != "reference"]
    for label, ops, threshold in (("quantize/dequantize", ("quantize", "dequantize"), 80.0),
                                  ("top-k prune/restore", ("topk_prune", "topk_restore"), 50.0)):
        sel = [r for r in kernels if r.op in ops]
        if not sel:
            out.append(f"{label} >= {threshold:.0f}% of copy bandwidth: not measured (no CUDA kernel).")
            continue
        low = min(sel, key=lambda r: r.pct_copy)
        miss = [r for r in sel if r.pct_copy < threshold]
        out.append(f"{'met' if not miss else 'NOT met'}: {label} >= {threshold:.0f}% of copy bandwidth in "
                   f"{len(sel) - len(miss)}/{len(sel)} rows; lowest {low.pct_copy:.0f}% "
                   f"({low.op} {low.config} {low.dtype}, {low.backend}).")
        out += _below([f"{r.op} {r.config} {r.dtype} {r.backend}: {r.pct_copy:.0f}%" for r in miss])
    if caveats:
        out.append("(" + "; ".join(caveats) + ")")
    return out


def _load_range(rows: list[Row]) -> str:
    loads = [r.loadavg for r in rows if r.loadavg is not None]
    if not loads:
        return "unknown"
    return f"{min(loads):.1f}-{max(loads):.1f}"


def _show_path(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _human(n: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= (1 << shift) and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n:,}"


def _csv_row(r: Row) -> dict:
    d = dataclasses.asdict(r)
    for k in ("ms", "gbps", "copy_gbps", "pct_copy", "speedup_vs_ref"):
        if d[k] is not None:
            d[k] = f"{d[k]:.6g}"
    return d


def write_results(out_dir: str, device, rows: list[Row], notes: list[str], targets: list[str],
                  numel: int, dtypes, command: str) -> tuple[str, str]:
    """kernels_<cpu|gpu>.{csv,md} in out_dir."""
    csv_path = _results.results_path("kernels", "csv", device, out_dir)
    md_path = _results.results_path("kernels", "md", device, out_dir)
    _results.write_rows(csv_path, [_csv_row(r) for r in rows], [f.name for f in fields(Row)])
    vers = _results.versions()
    first = rows[0] if rows else None
    what = "GPU" if device.type == "cuda" else "CPU"
    lines = [
        f"# slimfit kernel benchmark: {device.type.upper()}",
        "",
        f"- Device: `{device.type}`, {what}: {first.device_name if first else _results.device_name(device)}",
        f"- Versions: torch {vers['torch']}, triton {vers['triton']}, CUDA {vers['cuda']}, Python {vers['python']}",
        f"- Date: {first.date if first else _results.now()}",
        f"- Size: {numel:,} elements ({_human(numel)}), dtypes {', '.join(dtypes)}; quantize group size "
        f"{GROUP_SIZE}; top-k keeps {TOPK_KEEP:.0%} of each row by magnitude; dropout p={DROPOUT_P}",
        f"- Load: 1-minute load average {_load_range(rows)} during the run on {os.cpu_count()} logical "
        "CPUs (on a shared machine, numbers get noisy when it exceeds the CPU count)",
        f"- Timer: {first.timer if first else ''} (median); % copy compares with `dst.copy_(src)` moving "
        "the same bytes, measured right before each case",
        f"- Command: `{command}`",
        "",
        "## Targets (stated, not asserted)",
        "",
        f"Target: {TARGETS_TEXT[device.type]}",
        "",
    ]
    lines += [f"- {t}" if not t.startswith("  ") else f"  - {t.strip()}" for t in targets]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    lines += ["", "## Results", "", markdown_table(rows), ""]
    _results.write_text(md_path, "\n".join(lines))
    return csv_path, md_path


# ------------------------------------------------------------------ command line
def _parse_numel(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    n = int(float(s[:-1]) * mult[s[-1]]) if s and s[-1] in mult else int(float(s))
    if n < 1:
        raise argparse.ArgumentTypeError("numel must be at least 1")
    return n


def _parse_list(choices):
    def parse(s: str):
        items = [p.strip() for p in s.split(",") if p.strip()]
        bad = [p for p in items if p not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (comma-separated); got {s!r}")
        return items
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("all", "cpu", "cuda"), default="all",
                   help="devices to measure; 'all' = the CPU and the GPU when there is one (default)")
    p.add_argument("--numel", type=_parse_numel, default=None,
                   help="elements per tensor, e.g. 4M (default: 32M on CUDA, 4M on the CPU; 64K with --quick)")
    p.add_argument("--dtype", type=_parse_list(tuple(DTYPES)), default=["fp32", "bf16"],
                   help="float dtypes, comma-separated (default fp32,bf16)")
    p.add_argument("--ops", type=_parse_list(OPS), default=list(OPS),
                   help="ops to measure, comma-separated (default: all)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes and few repetitions: a smoke test, not numbers")
    p.add_argument("--out-dir", default=None,
                   help="where to write kernels_<cpu|gpu>.{csv,md} (default bench/results for a full run; "
                        "--quick and --ops runs write nothing unless this is given)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the CPU run")
    p.add_argument("--cpu-timer", choices=("wall", "process"), default="wall",
                   help="CPU clock: 'wall' = time.perf_counter (default); 'process' = time.process_time, "
                        "the process's CPU time, which other jobs on a busy shared machine do not inflate; "
                        "it sums all threads, so use it with --threads 1")
    return p.parse_args(argv)


def main(argv=None) -> list[Row]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    partial = args.quick or sorted(args.ops) != sorted(OPS)
    out_dir = args.out_dir or (None if partial else RESULTS_DIR)
    settings = _timing.Settings.quick() if args.quick else _timing.DEFAULT
    settings = dataclasses.replace(settings, cpu_clock=args.cpu_timer)
    devices = []
    if args.device in ("all", "cpu"):
        devices.append(torch.device("cpu"))
    if args.device in ("all", "cuda"):
        if torch.cuda.is_available():
            devices.append(torch.device("cuda", torch.cuda.current_device()))
        elif args.device == "cuda":
            raise SystemExit("bench/kernels.py: --device cuda but torch.cuda.is_available() is False")
    command = _results.command("kernels", argv)
    all_rows: list[Row] = []
    for device in devices:
        numel = args.numel or (QUICK_NUMEL if args.quick else DEFAULT_NUMEL[device.type])
        rows, notes = run_device(device, args.ops, numel, args.dtype, settings,
                                 log=lambda s: print(s, file=sys.stderr, flush=True))
        if device.type == "cpu" and args.cpu_timer == "process":
            notes.insert(0, "times are process CPU time (time.process_time), not wall time: robust to other "
                            "jobs on a shared machine, and equal to the wall time of an idle machine only "
                            f"with one thread (this run: {torch.get_num_threads()}).")
        targets = check_targets(device, rows, numel)
        vers = _results.versions()
        print(f"\n== {device.type}: {_results.device_name(device)} | torch {vers['torch']} | "
              f"triton {vers['triton']} | {numel:,} elements ({_human(numel)}) | median ms | "
              f"load {_load_range(rows)} on {os.cpu_count()} CPUs ==")
        print(text_table(rows))
        print(f"\nTarget ({device.type}, stated, not asserted): {TARGETS_TEXT[device.type]}")
        for t in targets:
            print(f"  {t}")
        for n in notes:
            print(f"  note: {n}")
        if out_dir:
            paths = write_results(out_dir, device, rows, notes, targets, numel, args.dtype, command)
            print("  wrote " + ", ".join(_show_path(p) for p in paths))
        else:
            print("  results not written (--quick/--ops run); pass --out-dir DIR to write them")
        all_rows += rows
    return all_rows


if __name__ == "__main__":
    main()
