"""The held step in one kernel: pieces whose moments are 8- or 4-bit dynamic codes, stepped by slimfit::adam_blockwise_.

held_step.step_held otherwise decodes a call's moments, runs torch's multi-tensor Adam on them and encodes
them back: about thirty ops a call and two fp32 temporaries of the call's size. Where every held entry is
a block-wise dynamic code (8 bits, the default, or 4) and the group is a plain Adam/AdamW, this module hands the
pieces to one op instead (slimfit/kernels/reference_adam.py states its arithmetic; C++ on the CPU, Triton on
a GPU): each element is read and written once, and nothing is allocated but the copies a scheduler reads.
So the pieces need no bound for their temporaries: every piece of a call that no observer watches goes into
one op, and a batch with watched pieces (their values before the update are copied for the scores) is its
own op, as held_step's batches bound those copies. Off the CPU the op scores the watched pieces itself
(``SCORES_IN_OP``): it sums each block's score of the move as it writes the weights, so a whole call is one
op and the scheduler's sums two more (no copies, no per-batch score ops). On the CPU the scores keep the
copies and the snapshot path's exact block order (scheduler/in_step.py).

Its random streams are a function of (parameter, moment, step count, the element's index in the whole
parameter): not of how pieces are cut or batched, so an FSDP2 shard's moments and weights are coded as the
whole parameter's would be at any world size (held_step's streams run on from a call's first piece).

Left to held_step (``fusable`` is False): amsgrad, maximize, capturable or differentiable groups, a
GradScaler's scale on the optimizer, a tensor learning rate, linear codes, and entries whose block sizes,
roundings or code widths differ.
"""
from __future__ import annotations

import torch

import slimfit.kernels  # noqa: F401  (registers torch.ops.slimfit.adam_blockwise_)
from slimfit.kernels import qmaps
from slimfit.kernels.reference_adam import SCORE_KINDS

from .keys import Q8

__all__ = ["fusable", "step_fused"]

_KEYS = ("exp_avg", "exp_avg_sq")
# Where the op sums the watched pieces' scores itself: "device" (pieces off the CPU), "always" (the CPU too:
# what the tests run the device path with), "never" (copies for every observer).
SCORES_IN_OP = "device"
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _entry_ok(entry: dict, sqrt: bool) -> bool:
    return (bool(entry.get("dynamic", False)) and int(entry.get("bits", 0)) in (4, 8) and bool(entry["sqrt"]) == sqrt
            and entry["codes"].dtype == torch.uint8)


def fusable(optimizer, group, states, params) -> bool:
    """Whether slimfit::adam_blockwise_ steps these held parameters exactly as the group asks."""
    if group["amsgrad"] or group["maximize"] or group.get("capturable") or group.get("differentiable"):
        return False
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return False
    if isinstance(group["lr"], torch.Tensor) or any(isinstance(b, torch.Tensor) for b in group["betas"]):
        return False
    formats = set()
    for p, st in zip(params, states):
        if p.dtype not in _FLOATS or p.grad is None or p.grad.dtype not in _FLOATS:
            return False
        m, v = st.get("exp_avg" + Q8), st.get("exp_avg_sq" + Q8)
        if m is None or v is None or not (_entry_ok(m, False) and _entry_ok(v, True)):
            return False
        formats |= {(int(e["group_size"]), bool(e.get("stochastic")), int(e["bits"])) for e in (m, v)}
    return len(formats) == 1   # one block size, rounding and code width for every entry of the call


def _launch(group, items, block_size: int, stochastic: bool, round_weights: bool, sums=(), score: int = 0,
            bits: int = 8) -> None:
    """One op over ``items``: (piece, grad piece, m entry, v entry, start, lr, step t, seeds, offset); ``sums``: a
    (3, blocks) tensor per item to score it into (empty: not scored), with the score kind ``score``."""
    beta1, beta2 = (float(b) for b in group["betas"])
    wd = float(group["weight_decay"])
    lists = {k: [] for k in ("p", "g", "mc", "ma", "vc", "va", "ss", "dec", "bc2", "seeds", "off")}
    per = 8 // bits   # codes a byte (a piece starts at a block boundary: on a byte)
    for piece, grad, m, v, a, lr, t, seeds, offset in items:
        b, e = a // block_size, -(-(a + piece.numel()) // block_size)
        c0, c1 = a // per, -(-(a + piece.numel()) // per)
        lists["p"].append(piece)
        lists["g"].append(grad)
        lists["mc"].append(m["codes"].view(-1)[c0:c1])
        lists["ma"].append(m["absmax"][b:e])
        lists["vc"].append(v["codes"].view(-1)[c0:c1])
        lists["va"].append(v["absmax"][b:e])
        lists["ss"].append(lr / (1.0 - beta1 ** t))
        lists["dec"].append(1.0 - lr * wd)
        lists["bc2"].append((1.0 - beta2 ** t) ** 0.5)
        lists["seeds"] += seeds
        lists["off"].append(offset)
    torch.ops.slimfit.adam_blockwise_(
        lists["p"], lists["g"], lists["mc"], lists["ma"], lists["vc"], lists["va"],
        qmaps.on_device("signed", bits, items[0][0]), qmaps.on_device("unsigned", bits, items[0][0]),
        lists["ss"], lists["dec"], lists["bc2"], beta1, beta2, float(group["eps"]), wd,
        bool(group.get("decoupled_weight_decay", False)), block_size, stochastic, lists["seeds"], lists["off"],
        round_weights, list(sums), score)


def _scored_in_op(observer, piece) -> int:
    """The op's score kind for a watched piece whose sums the op takes (0: the observer copies it instead)."""
    if SCORES_IN_OP == "never" or getattr(observer, "block_sums", None) is None:
        return 0
    if SCORES_IN_OP == "device" and piece.device.type == "cpu":
        return 0
    return SCORE_KINDS[observer.score_kind()]


def _sums_buffers(items, scored, block_size: int) -> list:
    """Per item, a (3, blocks) view of one new buffer for the scored ones (``scored``: their indices), an empty
    view for the others: one allocation for the call."""
    nbs = [-(-items[j][0].numel() // block_size) if j in scored else 0 for j in range(len(items))]
    buf = torch.empty(3 * sum(nbs), dtype=torch.float32, device=items[0][0].device)
    out, at = [], 0
    for nb in nbs:
        out.append(buf[at:at + 3 * nb].view(3, nb))
        at += 3 * nb
    return out


def step_fused(group, params, states, numbers, pieces_of, grads_of, starts, batches, watched, observer, holder,
               rounding, report, copies) -> None:
    """held_step.step_held's update of ``params`` through slimfit::adam_blockwise_ (``batches``: held_step's
    (factor, [(param index, start, end)]) batches; ``watched[i]``: the observer scores param i's pieces).
    Step counts move by one each; gradients are left to the caller."""
    first = states[0]["exp_avg" + Q8]
    block_size, stochastic = int(first["group_size"]), bool(first.get("stochastic", False))
    bits = int(first["bits"])
    round_weights = rounding is not None
    seeds_of: dict = {}

    def seeds(i):
        if i not in seeds_of:
            step = {"step": numbers[i]}
            w = rounding.seed(params[i], numbers[i], 0) if round_weights else 0
            seeds_of[i] = [holder.seed_for(params[i], k, step, start=0) for k in _KEYS] + [w]
        return seeds_of[i]

    def item(i, a, b, factor):
        st = states[i]
        return (pieces_of[i].view(-1)[a:b], grads_of[i].view(-1)[a:b], st["exp_avg" + Q8], st["exp_avg_sq" + Q8],
                a, float(group["lr"]) * factor, numbers[i] + 1, seeds(i), starts[i] + a)

    pending: dict = {}
    in_op = {i: _scored_in_op(observer, pieces_of[i]) for i in range(len(params)) if watched[i]}
    score = max(in_op.values(), default=0)
    for factor, batch in batches:
        if all(not watched[i] or in_op[i] for i, _, _ in batch):
            for i, a, b in batch:
                pending.setdefault(pieces_of[i].device, []).append((item(i, a, b, factor), i))
            continue
        items = [item(i, a, b, factor) for i, a, b in batch]
        seen = [j for j, (i, _, _) in enumerate(batch) if watched[i]]
        olds = dict(zip(seen, copies([items[j][0] for j in seen])))
        _launch(group, items, block_size, stochastic, round_weights, bits=bits)
        report(observer, [(params[batch[j][0]], batch[j][1], old, items[j][0]) for j, old in olds.items()])
    for entries in pending.values():
        items = [e for e, _ in entries]
        scored = {j for j, (_, i) in enumerate(entries) if watched[i]}
        sums = _sums_buffers(items, scored, block_size) if scored else ()
        _launch(group, items, block_size, stochastic, round_weights, sums, score if scored else 0, bits)
        if scored:
            observer.block_sums([(params[entries[j][1]], sums[j], items[j][0].numel()) for j in sorted(scored)])
