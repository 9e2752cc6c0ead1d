"""The Adam/AdamW step of parameters whose moments stay 8-bit between steps, a piece at a time.

With ``FrozenState(between_steps=True)`` on a plain optimizer, every parameter's moments (trained layers'
too) are held as codec.py's 8-bit entries from one step to the next. The ChunkedStep then updates such a
parameter piece by piece: it decodes the piece's moments, runs torch's functional Adam on the piece (the
group's hyperparameters, the parameter's own step count), and encodes the moments back into the entries
(each piece with its own stochastic-rounding seed). So no moment is ever in full: an 8-bit AdamW made of
slimfit's kernels, whose temporaries are a few pieces. A parameter's first step makes its entries directly
(all-zero codes decode to exactly 0, as torch's zero state), never a full zero tensor.

Lossy at every step (codec.py's bounds; what it costs in accuracy: docs/fidelity.md).
"""
from __future__ import annotations

import torch

from . import codec
from .keys import Q8
from .torch_adam import adam_step, lr_factors, scaled_group
from .weight_rounding import adam_step_rounded

__all__ = ["held_moments", "step_held", "new_held_state"]

_MOMENTS = (("exp_avg", False), ("exp_avg_sq", True))
_MAX = ("max_exp_avg_sq", True)


def held_moments(group) -> tuple:
    """(name, sqrt transform) of the moments an Adam group keeps."""
    return _MOMENTS + ((_MAX,) if group["amsgrad"] else ())


def is_held(state, group) -> bool:
    """Every moment of this parameter's state held 8-bit (and the step count plain)."""
    return "step" in state and all(k + Q8 in state and codec.is_encoded(state[k + Q8])
                                   for k, _ in held_moments(group))


def new_held_state(p, group, holder) -> dict:
    """A fresh Adam state for ``p`` with its moments held (torch's step count, zero moments as entries)."""
    from torch.optim.optimizer import _get_scalar_dtype

    fused = bool(group.get("fused"))   # as torch's _init_group: a fused step counts on the parameter's device
    state = {"step": torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device) if fused
             else torch.tensor(0.0, dtype=_get_scalar_dtype())}
    for key, sqrt in held_moments(group):
        state[key + Q8] = codec.zeros_entry(p.shape, p.dtype, p.device, sqrt=sqrt, **holder.codec_options())
    return state


def _aligned(chunk_numel: int, group_size: int) -> int:
    return max(group_size, -(-chunk_numel // group_size) * group_size)


@torch.no_grad()
def step_held(optimizer, group, params, chunk_numel: int, observer, holder, rounding=None) -> None:
    """torch's Adam step of ``params`` (held, each with a gradient), a piece at a time; gradients dropped.
    ``rounding`` (a WeightRounding, or None: nearest): bf16 / fp16 weights written by stochastic rounding."""
    moments = held_moments(group)
    for p, factor in zip(params, lr_factors(observer, params)):
        state = optimizer.state[p]
        step_t = state["step"]
        before = step_t.clone()
        count = before
        watched = observer is not None and observer.wants(p)
        flat_p, flat_g = p.view(-1), p.grad.view(-1)
        n = p.numel()
        chunk = _aligned(chunk_numel, int(state[moments[0][0] + Q8]["group_size"]))
        if n == 0:   # no piece to step: the count moves as torch's would
            count = before + 1
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            m = [codec.decode_range(state[k + Q8], a, b) for k, _ in moments]
            piece = flat_p[a:b]
            old = piece.clone() if watched else None
            count = before.clone()
            args = ([piece], [flat_g[a:b]], [m[0]], [m[1]], m[2:], [count])
            if rounding is None:
                adam_step(optimizer, scaled_group(group, factor), *args)
            else:
                adam_step_rounded(optimizer, scaled_group(group, factor), *args, [rounding.seed(p, before, a)])
            for (key, _), x in zip(moments, m):
                codec.encode_range_(state[key + Q8], a, x, seed=holder.seed_for(p, key, state, start=a))
            if old is not None:
                observer.piece(p, a, old, piece)
            del m, old
        step_t.copy_(count)
        p.grad = None
