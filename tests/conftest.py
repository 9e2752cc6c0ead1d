import os

import pytest
import torch

# Tests compare kernels with the reference; keep them deterministic and quiet.
torch.manual_seed(0)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def native_loaded() -> bool:
    from slimfit.kernels import backend_info

    return backend_info()["cpu"].startswith("native")


requires_native = pytest.mark.skipif(
    os.environ.get("SLIMFIT_BACKEND") == "reference" or not native_loaded(),
    reason="slimfit._C not built or SLIMFIT_BACKEND=reference",
)
