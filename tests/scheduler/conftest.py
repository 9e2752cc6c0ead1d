import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))   # tests/scheduler/_models.py, _ddp_worker.py


@pytest.fixture(autouse=True)
def _one_thread():
    """CI machines are small and shared: one intra-op thread keeps these tiny models fast
    (OpenMP fork/join on a busy machine costs more than the work). Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
