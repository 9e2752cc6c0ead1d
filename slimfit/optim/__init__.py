"""Optimizer-side memory: what AdamW costs beyond the weights, gradients and activations (docs/optim.md).

Three tools, usable together:

  frozen state     ``attach_frozen_state(scheduler, optimizer, mode="compress" | "offload")``: while the
                   scheduler keeps a layer frozen, its optimizer state is held 8-bit (3.76x fewer bytes) or on
                   the host, and put back when the scheduler picks the layer to train (frozen_state.py;
                   codec.py: the 8-bit format and its error bounds; transfer.py: host copies).
  step in backward ``step_in_backward(model, torch.optim.AdamW, lr=...)``: each parameter is updated by its
                   own optimizer as soon as its gradient is ready, and the gradient freed (in_backward.py):
                   the whole model's gradients and the multi-tensor optimizer's temporaries are never alive
                   at once.
  chunked step     ``attach_chunked_step(optimizer)``: torch's Adam/AdamW step taken at most 2**20
                   elements at a time, bit for bit the same (chunked_step.py); the scheduler attaches one
                   by default (``SchedulerConfig.step_chunk_numel``) and scores its trained layers in it.

The scheduler (slimfit.scheduler, pure Python) knows nothing of this package: FrozenState registers a
callback with ``ILSScheduler.register_frozen_set_hook``, and this package registers the factory that
``SchedulerConfig(frozen_state="compress" | "offload")`` calls (slimfit/scheduler/extensions.py).
"""
from slimfit.scheduler.config import STATE_CODES
from slimfit.scheduler.extensions import register_chunked_step, register_frozen_state

from .checkpoint import held_state_dict, restore_state, set_checkpoint_format
from .chunked_step import ChunkedStep, attach_chunked_step
from .codec import decode, encode, encoded_nbytes
from .frozen_state import MODES, FrozenState, attach_frozen_state
from .in_backward import CLIPPING_OPTIONS, InBackwardOptimizer, step_in_backward


# SchedulerConfig(frozen_state=...): the scheduler calls this when an optimizer is attached
def _scheduler_frozen_state(scheduler, optimizer, mode: str) -> FrozenState:
    """SchedulerConfig.frozen_state's holder: "compress_all" is compress with every layer's state held
    between steps, coded as SchedulerConfig.state_code says. The rounding seeds follow the run's seed (rank
    0's under torch.distributed, so that every replica rounds alike)."""
    between = mode == "compress_all"
    code, bits = STATE_CODES[scheduler.config.state_code]
    return attach_frozen_state(scheduler, optimizer, mode="compress" if between else mode,
                               seed=scheduler.run_seed % 2**62, between_steps=between, code=code, bits=bits)


register_frozen_state(_scheduler_frozen_state)
register_chunked_step(attach_chunked_step)

__all__ = [
    "FrozenState", "attach_frozen_state", "MODES", "restore_state", "set_checkpoint_format", "held_state_dict",
    "encode", "decode", "encoded_nbytes",
    "InBackwardOptimizer", "step_in_backward", "CLIPPING_OPTIONS", "ChunkedStep", "attach_chunked_step",
]
