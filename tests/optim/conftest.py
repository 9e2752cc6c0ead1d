import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))   # tests/optim/_optim_models.py


@pytest.fixture(autouse=True)
def _one_thread():
    """Shared 2-core machines: one intra-op thread keeps these small models fast and the sums in one order."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
