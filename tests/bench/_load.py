"""Load a script of bench/ as a module (bench/ is not a package)."""
from __future__ import annotations

import importlib.util
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(f"slimfit_bench_{name}", os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module
