"""Stochastic rounding of the bf16 / fp16 weights an Adam step writes (``weight_rounding="stochastic"``).

AdamW on bf16 weights loses the small updates: bf16 keeps 8 significant bits, so an update below half a
unit in the last place (ulp) of a weight is rounded away (a weight near 1.0 has an ulp of 2**-7; at lr 1e-4 an
Adam update of about 1e-4 never reaches it, step after step). The field's fix, where no fp32 master copy of
the weights is kept, is stochastic rounding of the updated weight (torchao's ``bf16_stochastic_round``, the
Gopher and Zamirai et al. recipe): the update is computed in fp32 and the weight is rounded to one of its two
neighbouring bf16 values with the probability that makes the expectation the fp32 result. An update of a
tenth of an ulp then moves the weight by one ulp one time in ten.

``adam_step_rounded`` is the chunked step's update of one batch of pieces with that rounding: the pieces'
weights, gradients and moments are copied to fp32 (a call's pieces at a time: the chunked step bounds them),
torch's functional Adam runs on the copies (the group's hyperparameters, as ``adam_step``), the moments go back to
their own dtype rounded to nearest (as torch's own bf16 step rounds them) and the weights stochastically.
fp32 weights are updated in place as ``adam_step`` updates them (nothing to round).

The random bits are slimfit's counter-based words (slimfit.kernels.rng): a function of (seed, element index),
so a step is deterministic given its seed and is the same on every device and every replica. The chunked step
derives one seed per piece from the run's seed, the parameter's place in the optimizer, its step count and the
piece's first element (``piece_seed``), and rounds the pieces of one call as one stream from the first piece's
seed: a run resumed from a checkpoint rounds as the uninterrupted one did.
"""
from __future__ import annotations

import hashlib

import torch

import slimfit.kernels  # noqa: F401  (registers torch.ops.slimfit.round_stochastic)
from slimfit.scheduler.config import WEIGHT_ROUNDINGS

from .torch_adam import adam_step

__all__ = ["WEIGHT_ROUNDINGS", "ROUNDED_DTYPES", "round_stochastic", "adam_step_rounded", "piece_seed",
           "WeightRounding", "check_weight_rounding"]

ROUNDED_DTYPES = (torch.bfloat16, torch.float16)


def piece_seed(seed: int, index: int, step: int, start: int) -> int:
    """The rounding seed of one piece: the run's ``seed``, the parameter's ``index`` in the optimizer, the step
    count before the update and the piece's first element (hashed: nearby pieces get unrelated streams)."""
    text = f"{int(seed)}:{int(index)}:{int(step)}:{int(start)}:weight".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") % 2**62


def round_stochastic(x: torch.Tensor, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``x`` (fp32) rounded to ``dtype`` (bf16 or fp16) stochastically and without bias: E[result] = x for
    every finite x in range. Values already representable stay; inf, NaN and values whose nearest rounding
    overflows round to nearest. One kernel (``torch.ops.slimfit.round_stochastic``: C++ on the CPU, Triton
    on a GPU; its formulas in slimfit/kernels/reference.py)."""
    if x.dtype != torch.float32:
        raise TypeError(f"round_stochastic: x must be float32 (the fp32 update), got {x.dtype}")
    if dtype not in ROUNDED_DTYPES:
        raise TypeError(f"round_stochastic: rounds to bfloat16 or float16, got {dtype}; fp32 weights need no "
                        "rounding")
    return torch.ops.slimfit.round_stochastic(x, dtype, int(seed))


def _fp32(ts: list) -> tuple[list, list]:
    """fp32 copies of the bf16 / fp16 tensors of ``ts`` (fp32 ones and Nones as they are), and the buffers
    behind them: the tensors of one dtype and device are copied by one concatenation and one cast (two ops,
    not one per tensor), each copy a view of its buffer. Buffers: (dtype, buffer, indices into ``ts``)."""
    out, runs = list(ts), {}
    for i, t in enumerate(ts):
        if t is not None and t.dtype in ROUNDED_DTYPES:
            runs.setdefault((t.dtype, t.device), []).append(i)
    buffers = []
    for (dtype, _), idx in runs.items():
        buf = (ts[idx[0]].reshape(-1) if len(idx) == 1 else torch.cat([ts[i].reshape(-1) for i in idx])).float()
        for i, view in zip(idx, buf.split([ts[i].numel() for i in idx])):
            out[i] = view.view(ts[i].shape)
        buffers.append((dtype, buf, idx))
    return out, buffers


def _write_back(dsts: list, srcs: list) -> None:
    """Each src copied (cast) into its dst where it is a copy, by one multi-tensor copy per dtype pair."""
    pairs: dict = {}
    for dst, src in zip(dsts, srcs):
        if dst is not None and src is not dst:
            pairs.setdefault((dst.dtype, dst.device), []).append((dst, src))
    for same in pairs.values():
        torch._foreach_copy_([d for d, _ in same], [s for _, s in same])


def adam_step_rounded(optimizer, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                      seeds) -> None:
    """``adam_step`` with the weights written by stochastic rounding (see the module docstring): the update
    computed in fp32 on copies of bf16 / fp16 pieces, the moments rounded back to nearest, the weights
    rounded stochastically. ``seeds`` has one seed per piece; the pieces of one dtype are rounded together, as
    one stream from the seed of the first of them (each piece at its own place in the stream: one rounding
    for the call, not one per piece)."""
    if not any(p.dtype in ROUNDED_DTYPES for p in params):
        adam_step(optimizer, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        return
    (p32, weights), (m32, _), (v32, _) = _fp32(params), _fp32(exp_avgs), _fp32(exp_avg_sqs)
    mx32 = _fp32(max_exp_avg_sqs)[0] if group["amsgrad"] else max_exp_avg_sqs
    adam_step(optimizer, group, p32, _fp32(grads)[0], m32, v32, mx32, steps)
    for dtype, buf, idx in weights:
        rounded = round_stochastic(buf, dtype, seeds[idx[0]])
        parts = rounded.split([params[i].numel() for i in idx])
        torch._foreach_copy_([params[i] for i in idx], [r.view(params[i].shape) for i, r in zip(idx, parts)])
    _write_back(exp_avgs, m32)
    _write_back(exp_avg_sqs, v32)
    if group["amsgrad"]:
        _write_back(max_exp_avg_sqs, mx32)


class WeightRounding:
    """The seeds of the stochastically rounded pieces of one ChunkedStep (a run's ``seed``); ``index(params)``
    names each parameter by its place among every parameter the step's optimizers hold."""

    def __init__(self, seed: int):
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"weight_rounding: seed must be an int, got {type(seed).__name__}")
        self.base = int(seed)
        self._index: dict = {}

    def index(self, params) -> None:
        """Number ``params`` (every parameter of the optimizers, in their order) for the seeds."""
        self._index = {id(q): i for i, q in enumerate(params)}

    def seed(self, p, step, start: int) -> int:
        """The seed of the piece of ``p`` from element ``start`` on, whose step count before the update is
        ``step`` (a 0-d tensor or a number)."""
        return piece_seed(self.base, self._index.get(id(p), -1), int(step), start)


def check_weight_rounding(value) -> str:
    """``value`` if it names a weight rounding, else a ValueError naming the choices."""
    if not (isinstance(value, str) and value in WEIGHT_ROUNDINGS):
        raise ValueError(f"weight_rounding must be one of {WEIGHT_ROUNDINGS}, got {value!r}: 'nearest' (torch's "
                         "own rounding) or 'stochastic' (bf16 / fp16 weights rounded stochastically)")
    return value
