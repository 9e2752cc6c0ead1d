import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Small models on a shared 2-core machine: one intra-op thread (and one summation order) per test."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
