import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))   # tests/scheduler/_models.py, _ddp_worker.py


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tests/conftest.py's one_thread) for every test here."""
