import os

import torch

# Without CUDA, Triton kernels run on CPU tensors in the interpreter. TRITON_INTERPRET must be
# set before anything imports triton (torch._dynamo, transformers and peft do, at import), so it
# is set here, in the first conftest pytest loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Tests compare kernels with the reference; keep them deterministic and quiet.
torch.manual_seed(0)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def threads_for_tests() -> int:
    """Intra-op threads of the optimizer and scheduler tests: 1 unless SLIMFIT_TEST_THREADS says otherwise. CI
    runs those tests at 1 and at 2 (.ci/run), so an outcome that hangs on one summation order fails at home."""
    value = os.environ.get("SLIMFIT_TEST_THREADS", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"SLIMFIT_TEST_THREADS must be a positive int, got {value!r}")
    return int(value)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (the shared 2-core machines: small models stay fast and sums keep one
    order), or SLIMFIT_TEST_THREADS of them; the previous count restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(threads_for_tests())
    yield
    torch.set_num_threads(n)


def native_loaded() -> bool:
    from slimfit.kernels import backend_info

    return backend_info()["cpu"].startswith("native")


requires_native = pytest.mark.skipif(
    os.environ.get("SLIMFIT_BACKEND") == "reference" or not native_loaded(),
    reason="slimfit._C not built or SLIMFIT_BACKEND=reference",
)
