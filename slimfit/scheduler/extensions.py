"""What other parts of slimfit plug into the scheduler, which imports none of them (it stays pure Python).

``SchedulerConfig.frozen_state`` asks for the frozen layers' optimizer state to be held compressed or on the
host; the code that does it (slimfit.optim.FrozenState) uses slimfit's kernels, so the scheduler only calls
the factory slimfit.optim registers here when it is imported (``import slimfit`` imports it).
"""
from __future__ import annotations

from typing import Callable, Optional

__all__ = ["register_frozen_state", "frozen_state_factory"]

_FROZEN_STATE: Optional[Callable] = None


def register_frozen_state(factory: Callable) -> None:
    """``factory(scheduler, optimizer, mode)`` -> an object with ``remove()``, called when an optimizer is
    attached to a scheduler whose config asks for frozen_state."""
    global _FROZEN_STATE
    _FROZEN_STATE = factory


def frozen_state_factory() -> Optional[Callable]:
    return _FROZEN_STATE
