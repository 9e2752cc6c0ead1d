import pytest

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _quiet_transformers():
    """Keep transformers' warnings out of the test output."""
    from slimfit.training.finetune import quiet_transformers

    quiet_transformers()
