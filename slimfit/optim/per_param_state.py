"""``optimizer.state`` of an in-backward optimizer: one mapping over the per-parameter optimizers' states.

Code that reads or edits ``optimizer.state`` (the scheduler's ``release_state_after``, FrozenState,
``slimfit.step_memory``, ``Optimizer.state_dict``) sees one ``{parameter: state dict}`` mapping, and every
change lands in the optimizer that owns the parameter, so a dropped state is really freed.
"""
from __future__ import annotations

from collections.abc import MutableMapping

__all__ = ["PerParamState"]


class PerParamState(MutableMapping):
    """``{p: optimizers[p].state[p]}`` for the parameters whose optimizer has state for them."""

    def __init__(self, optimizers: dict):
        self._optimizers = optimizers

    def _owner(self, p):
        opt = self._optimizers.get(p)
        if opt is None:
            raise KeyError("not a parameter of this optimizer")
        return opt

    def __getitem__(self, p):
        return self._owner(p).state[p]   # a defaultdict: an empty dict for a parameter with no state yet

    def __setitem__(self, p, value) -> None:
        self._owner(p).state[p] = value

    def __delitem__(self, p) -> None:
        del self._owner(p).state[p]

    def __contains__(self, p) -> bool:
        opt = self._optimizers.get(p)
        return opt is not None and p in opt.state

    def get(self, p, default=None):
        opt = self._optimizers.get(p)
        return default if opt is None else opt.state.get(p, default)

    def __iter__(self):
        return (p for p, opt in self._optimizers.items() if p in opt.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"PerParamState({len(self)} parameters with state)"
