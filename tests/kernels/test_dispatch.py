"""Which implementation serves torch.ops.slimfit on each device (slimfit/kernels/_ops.py)."""
import torch
from _backends import make_backend

from slimfit.kernels import SCHEMAS, backend_info


def test_cpu_kernels_are_native():
    make_backend("native")  # skips when the extension is not loaded
    for name in SCHEMAS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"slimfit::{name}", "CPU"), name
    assert backend_info()["native_error"] is None



def test_cpu_kernels_use_every_torch_thread():
    """The kernels' at::parallel_for compiles into the extension: built without torch's parallel
    backend (OpenMP's -fopenmp) it silently runs every CPU kernel on one thread."""
    make_backend("native")
    import slimfit._C as native

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        if not torch.backends.openmp.is_available():
            assert native.cpu_threads_used() == 1
            return
        assert native.cpu_threads_used() == 2
        torch.set_num_threads(1)
        assert native.cpu_threads_used() == 1
    finally:
        torch.set_num_threads(before)
