"""The trained layers scored inside the optimizer step, piece by piece, instead of against weight snapshots.

A layer's score compares its weights before and after the update (scores.py). With the optimizer's own
step that needs a copy of every trained weight (the snapshot) alive across the update. When the step is
taken a piece at a time (slimfit.optim.ChunkedStep, attached by default through
``SchedulerConfig.step_chunk_numel``), each piece's old values exist anyway for a moment: InStepScores adds
them to the layer's running sums (scores.BlockSums) right after the piece's update, so no snapshot is made.
On the CPU the score is the snapshot path's bit for bit (the same blocks, in the same order; tested);
elsewhere the sums of a call's pieces are computed together on the device (a few multi-tensor ops) and read
to the host once, when the scores are taken; they equal the snapshot path's up to rounding. There the
chunked step's fused held step (slimfit/optim/fused_held_step.py) has its op sum each block's score as it
writes the weights (``block_sums``): no copy of the old weights at all.

With ``update_scale="share"`` the observer also names each trained layer's catch-up factor (``lr_factor``): the
chunked step runs that layer's update at the group's learning rate times the factor, so the stretched update
costs no weight snapshot; the layer's score divides it out again (every score is linear in the update).

Parameters the chunked step leaves to the optimizer's own step (a fused group, a held state) are named to
``left_to_optimizer`` right before they move, and snapshotted there. Two updates before one
``ILSScheduler.step()`` add up: the score is the sum of each update's own.
"""
from __future__ import annotations

import weakref

from .scores import BlockSums, add_host_together

__all__ = ["InStepScores"]


class InStepScores:
    """The observer a ChunkedStep reports to, for one ILSScheduler (held weakly: no reference cycle)."""

    def __init__(self, scheduler):
        self._scheduler = weakref.ref(scheduler)
        self._flags = (None, -1, [])   # (the scheduler's trained-flag tensor, its version, its values)

    def _trained(self, sched) -> list:
        """The scheduler's trained flags as Python bools, read from their tensor once per change of it (one
        host read, not one per parameter and piece)."""
        t = sched._trained
        held, version, flags = self._flags
        if held is not t or version != t._version:
            flags = t.tolist()
            self._flags = (t, t._version, flags)
        return flags

    def _layer(self, p):
        sched = self._scheduler()
        if sched is None:
            return None, None
        i = sched._index.get(id(p))
        if i is None or not self._trained(sched)[i]:
            return sched, None
        return sched, i

    def wants(self, p) -> bool:
        return self._layer(p)[1] is not None

    def lr_factor(self, p) -> float:
        """The factor the coming update of ``p`` is stretched by (1.0: none). Every layer summed here was
        stretched by it: its score divides it out (ILSScheduler._score_trained)."""
        sched = self._scheduler()
        if sched is None or sched.config.update_scale == "none":   # the default: no per-layer lookup
            return 1.0
        sched, i = self._layer(p)
        return 1.0 if i is None else sched._coming_factor(i)

    def _sums_of(self, p):
        """The running score sums of ``p``'s layer (made at its first piece), or None: not a trained layer."""
        sched, i = self._layer(p)
        if i is None:
            return None
        sums = sched._sums.get(i)
        if sums is None:
            sums = sched._sums[i] = BlockSums(sched.config.effective_score, p.dtype, host=p.device.type == "cpu")
        return sums

    def piece(self, p, start: int, old, new) -> None:
        self.pieces([(p, start, old, new)])

    def pieces(self, items) -> None:
        """``piece(p, start, old, new)`` of each item, in order: the pieces on a device summed together
        (BlockSums.add_together: a few multi-tensor ops for all, one host read when the scores are taken), the
        small ones on the host too (add_host_together, the same sums as one at a time)."""
        on_device, on_host = [], []
        for p, _, old, new in items:
            sums = self._sums_of(p)
            if sums is not None:
                (on_host if sums.host else on_device).append((sums, old, new))
        if on_host:
            add_host_together(on_host)
        if on_device:
            BlockSums.add_together(on_device)

    def score_kind(self) -> str:
        """The score the scheduler ranks by (scores.SCORES): what an op that scores the pieces itself sums."""
        sched = self._scheduler()
        return "relative" if sched is None else sched.config.effective_score

    def block_sums(self, items) -> None:
        """Pieces the optimizer's op scored itself (slimfit::adam_blockwise_ with score sums): (p, block_sums,
        numel) each, added to the layers' sums together (BlockSums.add_block_sums_together), no copy of the
        old weights made."""
        taken = [(sums, block_sums, n) for sums, block_sums, n in ((self._sums_of(p), b, n) for p, b, n in items)
                 if sums is not None]
        if taken:
            BlockSums.add_block_sums_together(taken)

    def left_to_optimizer(self, params) -> None:
        sched = self._scheduler()
        if sched is not None:
            sched._take_snapshots(params)
