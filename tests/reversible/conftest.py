import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    # The models here are tiny: one thread is ~10x faster than two on a shared, busy 2-core machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
