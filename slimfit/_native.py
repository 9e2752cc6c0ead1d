"""Loads the compiled extension `slimfit._C` (kernels registered with torch.library).

The package works without it: the reference kernels serve, and a warning says so once.
"""
from __future__ import annotations

import importlib.util
import warnings

import torch

_WARNED = False


def load() -> tuple[bool, str | None]:
    global _WARNED
    try:
        spec = importlib.util.find_spec("slimfit._C")
        if spec is None or spec.origin is None:
            raise ImportError(
                "slimfit._C is not built (install with `pip install --no-build-isolation -e .` "
                "after torch, and without SLIMFIT_SKIP_NATIVE)"
            )
        torch.ops.load_library(spec.origin)
        return True, None
    except Exception as exc:  # missing, or built against another torch
        msg = f"{type(exc).__name__}: {exc}"
        if not _WARNED:
            warnings.warn(
                f"slimfit: native kernels unavailable ({msg}); using the pure-PyTorch reference "
                "kernels, which are correct but slower. Rebuild with "
                "`pip install --no-build-isolation -e .` to get them.",
                RuntimeWarning,
                stacklevel=3,
            )
            _WARNED = True
        return False, msg
