"""Which implementation serves torch.ops.slimfit on each device (slimfit/kernels/_ops.py)."""
import torch
from _backends import make_backend

from slimfit.kernels import SCHEMAS, backend_info


def test_cpu_kernels_are_native():
    make_backend("native")  # skips when the extension is not loaded
    for name in SCHEMAS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"slimfit::{name}", "CPU"), name
    assert backend_info()["native_error"] is None

