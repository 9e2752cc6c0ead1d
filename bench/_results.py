"""What the scripts of bench/ share to write results: where they go, CSV rows, Markdown and text
tables, and the machine, versions and commit that result headers name.

    path = results_path("accuracy_text", "csv", "cpu")     # bench/results/accuracy_text_cpu.csv
    done = read_rows(path)                                  # [] when the file is not there yet
    if not any(matches(r, method="full", seed=0) for r in done):
        append_row(path, row, FIELDS)                       # header written with the first row
    write_rows(path, merge_rows(read_rows(path), new, key=("model", "method")))
    lines = md_table(["method", "MiB"], [["plain", "12.0"]], right={1})
    header = f"{device_name('cpu')}, torch {versions()['torch']}, {now()}; `{command('e2e', ['--quick'])}`"

Results live in bench/results/<name>_<cpu|gpu>.{csv,md} (`--out-dir` or `--out` of a script moves
them). Result headers record the command in its file form, `python bench/<name>.py ...`
(bench/_shim.py; the same as `python -m bench.<name> ...`), the form the committed results were
generated with, so that re-rendering one does not change it.
"""
from __future__ import annotations

import csv
import datetime
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")


# ------------------------------------------------------------------ paths and commands
def device_tag(device) -> str:
    """'cpu' for the CPU, 'gpu' for any accelerator (a torch.device or a string such as 'cuda:0')."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    return "cpu" if kind == "cpu" else "gpu"


def results_path(name: str, ext: str, device=None, out_dir: str | None = None) -> str:
    """<out_dir or bench/results>/<name>_<cpu|gpu>.<ext>; without a device <name>.<ext>; ext "" leaves the
    extension off (a stem to add several to)."""
    stem = name if device is None else f"{name}_{device_tag(device)}"
    return os.path.join(out_dir or RESULTS_DIR, f"{stem}.{ext}" if ext else stem)


def command(script: str, argv: Sequence[str] | None = None) -> str:
    """`python bench/<script>.py` and its arguments (default: this process's), as result headers show it."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", f"bench/{script}.py", *(shlex.quote(str(a)) for a in args)])


# ------------------------------------------------------------------ CSV
def read_rows(path: str) -> list[dict]:
    """The rows of a CSV as dicts of strings; [] when the file does not exist."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def read_compare_rows(source: str) -> list[dict]:
    """The rows of a CSV to compare with: a file (`path/to/table.csv`), or a file as git history holds it
    (`REV:path`, e.g. `53f3e26:bench/results/kernels_static_sm90_before.csv`, read with `git show` from the
    repository root). A source that is neither is an error naming both forms."""
    if os.path.exists(source):
        with open(source, newline="") as fh:
            return list(csv.DictReader(fh))
    rev, sep, path = source.partition(":")
    if sep and rev and path:
        try:
            text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout
        except (OSError, subprocess.CalledProcessError) as exc:
            raise SystemExit(f"{source!r}: git cannot show it ({getattr(exc, 'stderr', '') or exc})".strip()) from None
        return list(csv.DictReader(text.splitlines()))
    raise SystemExit(f"{source!r}: no such file; give a CSV path or REV:PATH (a file in git history)")


def write_rows(path: str, rows: Sequence, fields: Sequence[str] | None = None) -> None:
    """Write a CSV anew: `rows` are dicts (columns: `fields`, default the first row's keys) or
    sequences of values (then `fields` is the header). Creates the folder."""
    os.makedirs(os.path.dirname(path) or os.curdir, exist_ok=True)
    with open(path, "w", newline="") as fh:
        if rows and not isinstance(rows[0], dict):
            writer = csv.writer(fh)
            writer.writerow(fields)
            writer.writerows(rows)
            return
        writer = csv.DictWriter(fh, fieldnames=list(fields or rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def append_row(path: str, row: dict, fields: Sequence[str]) -> None:
    """Append one row (a run that stops later keeps it); the header comes with the first row. A file whose
    header is not `fields` (a column added since) is rewritten with them first, its rows' new cells empty:
    appending under the old header would shift every later cell of the row."""
    new = not os.path.exists(path)
    if not new:
        with open(path, newline="") as fh:
            header = next(csv.reader(fh), [])
        if header != list(fields):
            unknown = [f for f in header if f not in fields]
            if unknown:
                raise ValueError(f"{path}: its columns {unknown} are not among the fields written now; "
                                 "move the file aside or add them to the fields")
            old = read_rows(path)
            with open(path, "w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=list(fields), lineterminator="\r\n")
                writer.writeheader()
                writer.writerows({f: r.get(f, "") for f in fields} for r in old)
    os.makedirs(os.path.dirname(path) or os.curdir, exist_ok=True)
    with open(path, "a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(fields))
        if new:
            writer.writeheader()
        writer.writerow(row)


def matches(row: dict, **values) -> bool:
    """Whether a CSV row holds these values, compared as the strings the CSV holds (seed=0 matches "0")."""
    return all(row.get(k, "") == str(v) for k, v in values.items())   # a column added since: empty


def merge_rows(old: Iterable, new: Iterable, key: Sequence[str] | Callable) -> list:
    """`old` with each row that `new` redoes (same key) replaced in place, the other rows of `new` appended
    in their order. `key`: field names (dict rows) or a function of a row."""
    key_of = key if callable(key) else (lambda r: tuple(str(r[k]) for k in key))
    fresh = {key_of(r): r for r in new}
    merged = [fresh.pop(key_of(r), r) for r in old]
    return merged + list(fresh.values())


# ------------------------------------------------------------------ tables
def _md_row(cells: Iterable) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def md_table(head: Sequence[str], body: Iterable[Sequence], right: Iterable[int] = ()) -> list[str]:
    """A Markdown table as lines; columns whose index is in `right` align right ('|' in cells escaped)."""
    right = set(right)
    rule = "|" + "|".join("---:" if i in right else "---" for i in range(len(head))) + "|"
    return [_md_row(head), rule] + [_md_row(b) for b in body]


def text_table(head: Sequence[str], body: Sequence[Sequence], right: Iterable[int] = ()) -> list[str]:
    """The same table for a terminal: padded columns, a dashed rule under the head."""
    right = set(right)
    lines = [[str(c) for c in line] for line in [head, *body]]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]

    def fmt(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [fmt(lines[0]).rstrip(), "  ".join("-" * w for w in widths)] + [fmt(b).rstrip() for b in lines[1:]]


def write_text(path: str, text: str) -> None:
    """Write a Markdown (or any text) file anew; creates the folder."""
    os.makedirs(os.path.dirname(path) or os.curdir, exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)


# ------------------------------------------------------------------ machine, versions, commit
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(device) -> str:
    """GPU name for CUDA devices; CPU model and torch's thread count for the CPU."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    n = torch.get_num_threads()
    return f"{cpu_model()} ({n} thread{'s' if n != 1 else ''})"


def versions() -> dict:
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = "none"
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda or "none",
        "python": platform.python_version(),
    }


def load_average() -> float | None:
    """1-minute load average (None where the OS has none): CPU numbers on a shared
    machine mean little when it is far above the core count."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def now() -> str:
    return datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")


def commit_label() -> str:
    """The commit the numbers ran at, and whether slimfit/ had uncommitted changes then."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "slimfit"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" + uncommitted changes in slimfit/" if dirty else "")
