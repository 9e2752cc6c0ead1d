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

The scheduler (slimfit.scheduler, pure Python) imports this package only inside
``ILSScheduler.attach_optimizer``, when its config asks for a chunked step or held moments: attach.py's
``attach_optimizer_side`` attaches both, with "auto" resolved by slimfit/_optimizer_state.py (the optimizer
state's vocabulary, shared with the scheduler and the planner). FrozenState follows the scheduler through
its public ``register_frozen_set_hook``.
"""
from .attach import attach_optimizer_side
from .checkpoint import held_state_dict, restore_state, set_checkpoint_format
from .chunked_step import ChunkedStep, attach_chunked_step
from .codec import decode, encode, encoded_nbytes
from .frozen_state import MODES, FrozenState, attach_frozen_state
from .in_backward import CLIPPING_OPTIONS, InBackwardOptimizer, step_in_backward

__all__ = [
    "FrozenState", "attach_frozen_state", "MODES", "restore_state", "set_checkpoint_format", "held_state_dict",
    "encode", "decode", "encoded_nbytes",
    "InBackwardOptimizer", "step_in_backward", "CLIPPING_OPTIONS", "ChunkedStep", "attach_chunked_step",
    "attach_optimizer_side",
]
