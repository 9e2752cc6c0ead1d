"""The Adam/AdamW step of parameters whose moments stay 8-bit between steps, a piece at a time.

With ``FrozenState(between_steps=True)`` on a plain optimizer, every parameter's moments (trained layers'
too) are held as codec.py's 8-bit entries from one step to the next. The ChunkedStep then updates such a
parameter piece by piece: it decodes the piece's moments, runs torch's functional Adam on the piece (the
group's hyperparameters, the parameter's own step count), and encodes the moments back into the entries
(the pieces of one call together, rounded stochastically from the seed of the call's first piece). So no
moment is ever in full: an 8-bit AdamW made of slimfit's kernels, whose temporaries are a few pieces. A
parameter's first step makes its entries directly (all-zero codes decode to exactly 0, as torch's zero
state), never a full zero tensor.

Lossy at every step (codec.py's bounds; what it costs in accuracy: docs/fidelity.md).
"""
from __future__ import annotations

import torch

from . import codec
from .fused_held_step import fusable, step_fused
from .keys import Q8
from .sharded_params import global_start, local
from .torch_adam import adam_step, lr_factors, scaled_group
from .weight_rounding import ROUNDED_DTYPES, adam_step_rounded

__all__ = ["held_moments", "step_held", "step_pieces", "new_held_state", "new_full_state", "report_pieces", "copies",
           "counts_of", "step_numbers"]

_MOMENTS = (("exp_avg", False), ("exp_avg_sq", True))
# Held parameters in the default code go through one op per call (fused_held_step.py); False: always the
# decode / torch's Adam / encode round below (what the tests compare the op with).
FUSED = True
_MAX = ("max_exp_avg_sq", True)


def held_moments(group) -> tuple:
    """(name, sqrt transform) of the moments an Adam group keeps."""
    return _MOMENTS + ((_MAX,) if group["amsgrad"] else ())


def is_held(state, group) -> bool:
    """Every moment of this parameter's state held 8-bit (and the step count plain)."""
    return "step" in state and all(k + Q8 in state and codec.is_encoded(state[k + Q8])
                                   for k, _ in held_moments(group))


def _new_step(p, group) -> torch.Tensor:
    """torch's step count of a fresh Adam state (as its _init_group: a fused step counts on the device)."""
    from torch.optim.optimizer import _get_scalar_dtype

    fused = bool(group.get("fused"))
    return (torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device) if fused
            else torch.tensor(0.0, dtype=_get_scalar_dtype()))


def new_full_state(p, group) -> dict:
    """A fresh Adam state for ``p`` as torch's _init_group makes it: the step count and zero moments in full."""
    state = {"step": _new_step(p, group)}
    for key, _ in held_moments(group):
        state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def new_held_state(p, group, holder) -> dict:
    """A fresh Adam state for ``p`` with its moments held (torch's step count, zero moments as entries)."""
    state = {"step": _new_step(p, group)}
    shape = local(p).shape   # an FSDP2 shard's entries code this rank's piece (sharded_params.py)
    for key, sqrt in held_moments(group):
        state[key + Q8] = codec.zeros_entry(shape, p.dtype, p.device, sqrt=sqrt, **holder.codec_options())
    return state


def _aligned(chunk_numel: int, group_size: int) -> int:
    return max(group_size, -(-chunk_numel // group_size) * group_size)


def _batches(params, states, factors, chunk_numel: int, first_key: str):
    """Batches of pieces (param index, start, end): each piece starts at a multiple of its entries' group
    size, and consecutive pieces of parameters with the same learning-rate factor and step-count device are
    packed into one batch of at most the largest piece's elements (one piece may fill it). A batch holds
    parameters of one kind (tensor class, device, dtype), as one multi-tensor call of torch's step takes them:
    the planner's fake parameters and real ones never share a call."""
    runs: dict = {}
    for i, p in enumerate(params):
        runs.setdefault((factors[i], states[i]["step"].device, type(p), p.device, p.dtype), []).append(i)
    # a call is at most the largest piece: its temporaries are no larger than one piece's alone
    aligns = [int(st[first_key]["group_size"]) for st in states]
    limit = min(chunk_numel, max((min(p.numel(), _aligned(chunk_numel, g)) for p, g in zip(params, aligns)),
                                 default=chunk_numel))
    for (factor, *_), idx in runs.items():
        batch, size = [], 0
        for i in idx:
            n = params[i].numel()
            chunk = _aligned(chunk_numel, aligns[i])
            for a in range(0, n, chunk):
                b = min(n, a + chunk)
                if batch and size + b - a > limit:
                    yield factor, batch
                    batch, size = [], 0
                batch.append((i, a, b))
                size += b - a
        if batch:
            yield factor, batch


def copies(pieces) -> list:
    """Copies of the weight pieces (the values before an update), one op per dtype and device: a
    concatenation, split back into views."""
    out = [None] * len(pieces)
    by_dtype: dict = {}
    for j, t in enumerate(pieces):
        by_dtype.setdefault((t.dtype, t.device), []).append(j)
    for idx in by_dtype.values():
        for j, t in zip(idx, torch.cat([pieces[j] for j in idx]).split([pieces[j].numel() for j in idx])):
            out[j] = t
    return out


def counts_of(steps) -> list:
    """A step count per piece, each starting from its parameter's count (``steps``, one per piece; torch's
    step counts each up by one): one op for a call's pieces on one device, not a clone per piece."""
    if len({(type(s), s.device) for s in steps}) == 1:
        # new tensors, not views of one stack: torch's step adds to each in place, which the planner's fake
        # tensors refuse for views made under no_grad
        return list(torch._foreach_add(steps, 0))
    return [s.clone() for s in steps]


def report_pieces(observer, items) -> None:
    """Each (p, start, old, new) of a call told to ``observer``: all at once through its ``pieces`` when it has
    one (the scheduler sums a call's pieces together), else ``piece`` by piece."""
    many = getattr(observer, "pieces", None)
    if many is not None:
        many(items)
        return
    for item in items:
        observer.piece(*item)


def _seed(holder, p, key: str, step: float, start: int) -> int:
    """The holder's encoding seed of a piece, from the step count read once per call (no host read here)."""
    return holder.seed_for(p, key, {"step": step}, start=start)


def step_numbers(steps) -> list:
    """The step counts (0-d tensors) as numbers, read on the host once for all (one stack, one transfer)."""
    return torch.stack(steps).tolist() if len({s.device for s in steps}) == 1 else [float(s) for s in steps]


@torch.no_grad()
def step_held(optimizer, group, params, chunk_numel: int, observer, holder, rounding=None) -> None:
    """torch's Adam step of ``params`` (held, each with a gradient), a batch of pieces at a time; gradients
    dropped. ``rounding`` (a WeightRounding, or None: nearest): bf16 / fp16 weights written by stochastic
    rounding.

    Launches: a batch packs pieces of several parameters (at most about ``chunk_numel`` elements in all)
    into one call of torch's functional Adam, its moments decoded and encoded by codec.decode_ranges /
    encode_ranges_ (one dequantize and one quantize per moment over the call's pieces concatenated, the rest
    multi-tensor; a moment's pieces in one call are rounded from the seed of the call's first piece, the
    stream running on over the others), and every step count is read on the host once per call (the
    encoding seeds), not once per piece."""
    moments = held_moments(group)
    states = [optimizer.state[p] for p in params]
    if rounding is not None and not any(p.dtype in ROUNDED_DTYPES for p in params):
        rounding = None   # fp32 weights: nothing to round
    # FSDP2 shards: the rank's pieces stepped, seeded from where they sit in the whole parameter
    pieces_of = [local(p) for p in params]
    batches = _batches(pieces_of, states, lr_factors(observer, params), chunk_numel, moments[0][0] + Q8)
    if FUSED and fusable(optimizer, group, states, params):
        steps = [st["step"] for st in states]
        step_fused(group, params, states, step_numbers(steps), pieces_of, [local(p.grad) for p in params],
                   [global_start(p) for p in params], batches, [observer is not None and observer.wants(p)
                                                                 for p in params], observer, holder,
                   rounding, report_pieces, copies)
        torch._foreach_add_(steps, 1)
        for p in params:
            p.grad = None
        return

    def load(batch, numbers, starts):
        return [codec.decode_ranges([(states[i][k + Q8], a, b) for i, a, b in batch]) for k, _ in moments]

    def store(batch, m, numbers, starts):
        codec.encode_ranges_([(states[i][key + Q8], a, x, _seed(holder, params[i], key, numbers[i], a + starts[i]))
                              for (key, _), xs in zip(moments, m) for (i, a, _), x in zip(batch, xs)])

    step_pieces(optimizer, group, params, batches, observer, rounding, load, store)


@torch.no_grad()
def step_pieces(optimizer, group, params, batches, observer, rounding, load, store) -> None:
    """torch's functional Adam over ``batches`` (lr factor, [(param index, start, end)]) of ``params``' pieces,
    the moments of a batch's pieces got from ``load(batch, numbers, starts)`` (a list per moment, a tensor per
    piece) and handed back to ``store(batch, moments, numbers, starts)`` after the update (``numbers``: the
    step counts read once; ``starts``: where each local piece sits in the whole parameter). Step counts move
    by one, the observer sees each watched piece before and after, gradients are dropped."""
    states = [optimizer.state[p] for p in params]
    steps = [st["step"] for st in states]
    numbers = step_numbers(steps)
    watched = [observer is not None and observer.wants(p) for p in params]
    last: list = [None] * len(params)
    pieces_of, grads_of = [local(p) for p in params], [local(p.grad) for p in params]
    starts = [global_start(p) for p in params]
    for factor, batch in batches:
        pieces = [pieces_of[i].view(-1)[a:b] for i, a, b in batch]
        m = load(batch, numbers, starts)
        seen = [j for j, (i, _, _) in enumerate(batch) if watched[i]]
        olds = dict(zip(seen, copies([pieces[j] for j in seen]))) if seen else {}
        counts = counts_of([steps[i] for i, _, _ in batch])
        args = (pieces, [grads_of[i].view(-1)[a:b] for i, a, b in batch], m[0], m[1], m[2] if len(m) > 2 else [],
                counts)
        if rounding is None:
            adam_step(optimizer, scaled_group(group, factor), *args)
        else:
            adam_step_rounded(optimizer, scaled_group(group, factor), *args,
                              [rounding.seed(params[i], numbers[i], a + starts[i]) for i, a, _ in batch])
        store(batch, m, numbers, starts)
        for j, (i, _, _) in enumerate(batch):
            last[i] = counts[j]
        if olds:
            report_pieces(observer, [(params[batch[j][0]], batch[j][1], old, pieces[j]) for j, old in olds.items()])
        del m, olds, pieces, args
    moved = [(s, c) for s, c in zip(steps, last) if c is not None]
    if moved:
        torch._foreach_copy_([s for s, _ in moved], [c for _, c in moved])
    for s, c in zip(steps, last):
        if c is None:   # no element to step: the count moves as torch's would
            s.add_(1)
    for p in params:
        p.grad = None
