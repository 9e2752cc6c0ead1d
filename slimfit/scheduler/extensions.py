"""What other parts of slimfit plug into the scheduler, which imports none of them (it stays pure Python).

``SchedulerConfig.frozen_state`` asks for the frozen layers' optimizer state to be held compressed or on the
host; the code that does it (slimfit.optim.FrozenState) uses slimfit's kernels, so the scheduler only calls
the factory slimfit.optim registers here when it is imported (``import slimfit`` imports it).
``SchedulerConfig.step_chunk_numel`` asks for the optimizer step chunk by chunk (slimfit.optim.ChunkedStep),
registered the same way.
"""
from __future__ import annotations

from typing import Callable, Optional

__all__ = ["register_frozen_state", "frozen_state_factory", "register_chunked_step", "chunked_step_factory"]

_FROZEN_STATE: Optional[Callable] = None
_CHUNKED_STEP: Optional[Callable] = None


def register_frozen_state(factory: Callable) -> None:
    """``factory(scheduler, optimizer, mode)`` -> an object with ``remove()``, called when an optimizer is
    attached to a scheduler whose config asks for frozen_state."""
    global _FROZEN_STATE
    _FROZEN_STATE = factory


def frozen_state_factory() -> Optional[Callable]:
    return _FROZEN_STATE


def register_chunked_step(factory: Callable) -> None:
    """``factory(optimizer, chunk_numel, observer)`` -> an object with ``active`` and ``remove()``, called
    when an optimizer is attached to a scheduler whose config sets step_chunk_numel."""
    global _CHUNKED_STEP
    _CHUNKED_STEP = factory


def chunked_step_factory() -> Optional[Callable]:
    return _CHUNKED_STEP
