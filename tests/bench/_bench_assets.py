"""Whether the offline assets the benchmark smoke tests train on are installed."""
from slimfit.demo.assets import MissingAsset, minilm_dir


def minilm_present() -> bool:
    try:
        minilm_dir()
        return True
    except MissingAsset:
        return False
