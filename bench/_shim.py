"""The file form of a benchmark: `python bench/<name>.py` runs the module `bench.<name>` exactly as
`python -m bench.<name>` from the repository root does.

Every script of bench/ starts with

    if __name__ == "__main__" and not __package__:  # file form: python bench/<name>.py (bench/_shim.py)
        import _shim
        _shim.run_as_module(__file__)

A file run puts bench/ itself first on sys.path, where `_shim` is found as a top-level module and
`bench` is not found at all. run_as_module puts the repository root in that entry instead (the one
sys.path edit in bench/, for this form only), so that `bench` and this tree's slimfit import as they do
under `python -m`, runs the module as __main__, and exits with its status. Under `python -m bench.<name>`
or an import, `__package__` is "bench" and none of this runs.
"""
from __future__ import annotations

import os
import runpy
import sys

BENCH = os.path.dirname(os.path.realpath(__file__))
ROOT = os.path.dirname(BENCH)


def run_as_module(path: str) -> None:
    name = os.path.splitext(os.path.basename(path))[0]
    entries = [os.path.realpath(p or os.curdir) for p in sys.path]
    if BENCH in entries:
        sys.path[entries.index(BENCH)] = ROOT
    else:
        sys.path.insert(0, ROOT)
    runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)
    raise SystemExit(0)
