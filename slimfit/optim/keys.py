"""The keys under which a held (compressed or offloaded) state entry sits in ``optimizer.state[p]``."""
from __future__ import annotations

__all__ = ["Q8", "HOST", "held_key", "base_key"]

Q8 = "@slimfit_q8"      # state[p][key + Q8]: codec.encode's entry of state[p][key]
HOST = "@slimfit_host"  # state[p][key + HOST]: the host copy of state[p][key]


def held_key(key) -> bool:
    return isinstance(key, str) and (key.endswith(Q8) or key.endswith(HOST))


def base_key(key: str) -> str:
    """``exp_avg@slimfit_q8`` -> ``exp_avg``."""
    return key[: -len(Q8)] if key.endswith(Q8) else key[: -len(HOST)]
