"""The optimizer side of an ILSScheduler: what is attached to an optimizer when the scheduler's config asks
for the chunked step (``SchedulerConfig.step_chunk_numel``) or for held moments (``optimizer_state``).

The scheduler stays pure Python: ``ILSScheduler.attach_optimizer`` imports this module by name, inside the
method, when the config asks for either, and keeps what ``attach_optimizer_side`` returns (its
``chunked_step`` and ``state_holder``). What is read of the scheduler is its public surface: ``config``,
``run_seed``, ``step_observer`` (the in-step scores a ChunkedStep reports to) and, through FrozenState.attach,
``register_frozen_set_hook`` and ``state_holder``. What "auto" holds is slimfit/_optimizer_state.py's
``resolve_state_mode``, given what this optimizer's step can hold.
"""
from __future__ import annotations

from typing import Optional

from slimfit._optimizer_state import (
    HOLDERS,
    NEAREST_STATE_CODES,
    STATE_CODES,
    resolve_state_mode,
    resolve_step_chunk_numel,
    unwrap_optimizer,
)

from .chunked_step import ChunkedStep, attach_chunked_step
from .frozen_state import FrozenState, attach_frozen_state

__all__ = ["attach_optimizer_side", "step_kind", "state_code_options"]


def attach_optimizer_side(scheduler, optimizer, chunked: bool = True
                          ) -> tuple[Optional[ChunkedStep], Optional[FrozenState]]:
    """(the ChunkedStep, the FrozenState) attached to ``optimizer`` as ``scheduler.config`` asks; either is
    None when not asked for or not possible (a chunked step takes only a torch Adam/AdamW that is neither fused
    nor capturable; ``chunked=False``: none, for sharded parameters, whose scores are sums over shards). The
    chunked step comes first: an "8bit" holder steps through it. When the holder is refused (a mode the
    optimizer's step cannot hold) the chunked step is taken off again and the error raised."""
    step = _chunked_step(scheduler, optimizer) if chunked and scheduler.config.step_chunk_numel is not None else None
    try:
        holder = _holder(scheduler, optimizer, step)
    except BaseException:
        if step is not None:
            step.remove()
        raise
    return step, holder


def step_kind(optimizer, step: Optional[ChunkedStep]) -> str:
    """What ``optimizer``'s step can hold (slimfit/_optimizer_state.py's STEP_KINDS): "every" under a chunked
    step or for step_in_backward's per-parameter optimizer, else "frozen"."""
    per_param = hasattr(unwrap_optimizer(optimizer), "register_param_step_post_hook")   # step_in_backward
    return "every" if step is not None or per_param else "frozen"


def _chunked_step(scheduler, optimizer) -> Optional[ChunkedStep]:
    """config.step_chunk_numel's ChunkedStep ("auto" resolved by the parameters' device and numel), reporting
    to the scheduler's in-step scores (None: it takes nothing of this optimizer); bf16 / fp16 weights rounded
    as config.weight_rounding says."""
    config = scheduler.config
    params = [p for g in unwrap_optimizer(optimizer).param_groups for p in g["params"]]
    step = attach_chunked_step(optimizer, resolve_step_chunk_numel(config.step_chunk_numel, params),
                               scheduler.step_observer)
    if config.effective_weight_rounding != "nearest":
        step.set_weight_rounding(config.effective_weight_rounding, scheduler.run_seed)
    if step.active:
        return step
    step.remove()
    return None


def _holder(scheduler, optimizer, step: Optional[ChunkedStep]) -> Optional[FrozenState]:
    """config.optimizer_state's FrozenState (None: nothing held), its moments coded as config.state_code
    says. The rounding seeds follow the run's seed (rank 0's under torch.distributed, so that every replica
    rounds alike)."""
    config = scheduler.config
    mode = resolve_state_mode(config.optimizer_state, step_kind(optimizer, step),
                              config.experimental.frozen_update != "none")
    if mode is None:
        return None
    held, between_steps = HOLDERS[mode]
    if mode == "host" and step_kind(optimizer, step) != "every":
        raise ValueError("optimizer_state='host' holds every layer's moments in host memory, streamed to the "
                         "device a piece at a time inside the step, which needs slimfit's chunked step (a torch "
                         "Adam/AdamW that is neither fused nor capturable, with the scheduler's default "
                         "step_chunk_numel) or slimfit.optim.step_in_backward(model, torch.optim.AdamW, ...); "
                         "or choose 'host-frozen' (the frozen layers' moments on the host) for this optimizer")
    return attach_frozen_state(scheduler, optimizer, mode=held, seed=scheduler.run_seed % 2**62,
                               between_steps=between_steps, **state_code_options(config.state_code))


def state_code_options(state_code: str) -> dict:
    """FrozenState's code, bits and stochastic for a SchedulerConfig.state_code."""
    code, bits = STATE_CODES[state_code]
    return {"code": code, "bits": bits, "stochastic": state_code not in NEAREST_STATE_CODES}
