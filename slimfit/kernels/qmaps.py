"""Code maps of block-wise dynamic quantization (slimfit::quantize_blockwise): sorted fp32 levels in [-1, 1].

A block of values is divided by its largest magnitude (absmax), so every value y lies in [-1, 1]; its code
is the index of the nearest level of the map, or with stochastic rounding of one of the two levels around y
(the upper with probability y's place between them: slimfit/kernels/reference.py). A linear grid spends
most of its levels on the top decade of a block: a small value next to a large one rounds to 0. Optimizer
moments span decades inside a block, so the maps below are *dynamic*: a few levels per decade all the way
down, most levels in the top decade.

The dynamic tree (Dettmers, "8-bit approximations for parallelism in deep learning", 2016; the map of
bitsandbytes' 8-bit optimizers): a code is a sign bit, then E zero bits (the decade: a factor 10^-E), a 1
bit ending them, and the remaining F bits a linear fraction. Written as a set of levels, which is all the
kernels need: the decade (10^-(E+1), 10^-E] holds 2^F evenly spaced levels

    10^-E * (0.1 + 0.9 * (j + 1) / 2^F),   j = 0 .. 2^F - 1       (its top level is 10^-E itself)

with F = (bits of magnitude) - 1 - E: each decade down has half the levels of the one above. So 1.0 is a
level: the element that sets a block's absmax is restored exactly. The codes are the levels' indices in
ascending order, not the tree's bit patterns.

signed(bits)    the first moment (exp_avg: any sign). One sign bit, bits - 1 bits of magnitude: decades
                E = 0 .. bits - 2 on each side and 0 make 2^bits - 1 levels; the one code left is one more
                positive level a decade further down (10^-(bits-1)), so the map is symmetric but for it.
                8-bit: 0, +-1e-6 .. +-1 (127 levels a side) and +1e-7. 4-bit: 0, +-0.01 .. +-1 (7 a side),
                +0.001.
unsigned(bits)  the second moment (exp_avg_sq >= 0), with NO ZERO level (Li, Chen, Zhu, "Memory Efficient
                Optimizers with 4-bit States", NeurIPS 2023: a nonzero v restored as 0 makes AdamW's
                update m / (sqrt(v) + eps) explode). All bits are magnitude: decades E = 0 .. bits - 1 make
                2^bits - 1 levels, and the code left is a level a decade further down (10^-bits), where a
                map with zero would have put 0. 8-bit: 1e-8 .. 1; 4-bit: 1e-4 .. 1. Anything below
                half-way to the second level is restored at the smallest one: above, never below.
linear_unsigned(bits)
                the alternative Li et al. use for the 4-bit second moment: (i + 1) / 2^bits, i = 0 .. 2^bits - 1
                (no zero either). Kept for the measurement that chose the codec's map (codec.py).

Relative levels (smallest nonzero magnitude .. largest), and the largest relative gap between two
neighbouring levels in the top decade (half of it bounds the nearest rounding's error of a value there,
relative to its block's absmax; the whole of it the stochastic rounding's):

    map                smallest   largest   levels   top-decade step
    signed(8)          1e-7       1         256      0.9 / 64  = 0.0141
    signed(4)          1e-3       1         16       0.9 / 4   = 0.225
    unsigned(8)        1e-8       1         256      0.9 / 128 = 0.00703
    unsigned(4)        1e-4       1         16       0.9 / 8   = 0.1125
    linear_unsigned(4) 0.0625     1         16       0.0625

Levels are computed in float64 and rounded once to fp32. Maps are built once per (kind, bits) and cached
on the CPU; ``on_device`` gives the cached copy on a device (a fake tensor's device gets a fresh empty map
of the right size: under FakeTensorMode only shapes matter).
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

__all__ = ["signed", "unsigned", "linear_unsigned", "MAPS", "on_device", "bits_of", "code_of_zero"]

LEVELS = {4: 16, 8: 256}


def _check_bits(bits: int) -> None:
    if bits not in LEVELS:
        raise ValueError(f"slimfit.kernels.qmaps: bits must be 4 or 8 (16 or 256 levels), got {bits!r}")


def _tree(magnitude_bits: int) -> list[float]:
    """The positive levels of a dynamic tree with `magnitude_bits` bits (2^magnitude_bits - 1 of them),
    plus one level a decade below its last one (the code a map gives to 0 or to a sign of 0)."""
    levels = []
    for e in range(magnitude_bits):
        f = magnitude_bits - 1 - e
        levels += [10.0 ** -e * (0.1 + 0.9 * (j + 1) / 2**f) for j in range(2**f)]
    return levels + [10.0 ** -magnitude_bits]


def _as_map(levels: list[float], bits: int) -> torch.Tensor:
    with unset_fake_temporarily():   # a real map even when first asked under fakes
        out = torch.tensor(sorted(levels), dtype=torch.float64).to(torch.float32)
    assert out.numel() == LEVELS[bits] and bool((out[1:] > out[:-1]).all()), "a map must be strictly increasing"
    return out


@functools.cache
def _signed(bits: int) -> torch.Tensor:
    tree = _tree(bits - 1)
    positive, extra = tree[:-1], tree[-1]
    return _as_map([-v for v in positive] + [0.0] + positive + [extra], bits)


@functools.cache
def _unsigned(bits: int) -> torch.Tensor:
    return _as_map(_tree(bits), bits)


@functools.cache
def _linear_unsigned(bits: int) -> torch.Tensor:
    n = LEVELS[bits]
    return _as_map([(i + 1) / n for i in range(n)], bits)


def signed(bits: int = 8) -> torch.Tensor:
    """The signed dynamic map (first moments): 2^bits fp32 levels in [-1, 1], 0 and +-1 among them."""
    _check_bits(bits)
    return _signed(bits).clone()


def unsigned(bits: int = 8) -> torch.Tensor:
    """The unsigned dynamic map without a zero level (second moments): 2^bits fp32 levels in (0, 1]."""
    _check_bits(bits)
    return _unsigned(bits).clone()


def linear_unsigned(bits: int = 4) -> torch.Tensor:
    """(i + 1) / 2^bits: the linear map without zero (Li et al.'s second-moment map)."""
    _check_bits(bits)
    return _linear_unsigned(bits).clone()


MAPS = {"signed": _signed, "unsigned": _unsigned, "linear_unsigned": _linear_unsigned}
_ON_DEVICE: dict = {}
# A FakeTensorMode's maps, by the mode's id, held weakly: a fake map lives as long as someone holds it (a
# planned step's FrozenState, as a real run's holds the real one through _ON_DEVICE). Not an attribute of the
# mode: mode -> maps -> fake tensor -> mode is a cycle that keeps modes alive until a GC pass, and torch
# crashed converting tensors while such a pass collected one (2 threads, tests/plan). A live map holds its
# mode, so the id cannot be reused while its entry exists.
_FAKE_MAPS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def on_device(kind: str, bits: int, like: torch.Tensor) -> torch.Tensor:
    """The map ``kind`` at ``bits`` on ``like``'s device, cached (never modify it). For a fake tensor (a
    FakeTensorMode's: slimfit.plan) an empty map of the right size made like it, shared while anyone holds it
    (a planned step's FrozenState holds its maps as a real run holds the real ones)."""
    _check_bits(bits)
    key = (kind, bits, like.device)
    if isinstance(like, FakeTensor):
        fake_key = (id(like.fake_mode),) + key
        qmap = _FAKE_MAPS.get(fake_key)
        if qmap is None:
            qmap = _FAKE_MAPS[fake_key] = like.new_empty(LEVELS[bits], dtype=torch.float32)
        return qmap
    qmap = _ON_DEVICE.get(key)
    if qmap is None:
        with unset_fake_temporarily():   # a real map, even when a real tensor is met under a FakeTensorMode
            qmap = _ON_DEVICE[key] = MAPS[kind](bits).to(like.device)
    return qmap


@functools.cache
def code_of_zero(kind: str, bits: int) -> int:
    """The code quantize_blockwise gives y = 0 with the map ``kind``: the count of midpoints below 0 (the
    index of the signed map's 0 level; 0 for an unsigned map). Plain Python, no tensor op: usable under a
    FakeTensorMode (an all-zero entry made by slimfit.plan)."""
    _check_bits(bits)
    with unset_fake_temporarily():
        values = MAPS[kind](bits).tolist()
    return sum((a + b) * 0.5 < 0 for a, b in zip(values, values[1:]))


def bits_of(qmap: torch.Tensor) -> int:
    """4 or 8: the code width of a map of 16 or 256 levels."""
    return {16: 4, 256: 8}[qmap.numel()]
