"""The dynamic code of codec.py: one optimizer moment as block-wise dynamic codes (8 or 4 bits).

This is the field's codec for optimizer state (bitsandbytes' 8-bit Adam, torchao's AdamW8bit/4bit, Li et
al.'s 4-bit Adam), on slimfit's own kernels (``slimfit::quantize_blockwise`` / ``dequantize_blockwise``):
per block of ``group_size`` consecutive elements of the flattened moment, the block's largest magnitude
(fp32) and, per element, the index of a level of a map (slimfit/kernels/qmaps.py):

  first moment  (exp_avg, momentum_buffer, ...)  the signed dynamic map: 0, +-1e-6 .. +-1 and +1e-7 at
                8 bits; 0, +-0.01 .. +-1 and +0.001 at 4 bits. An exact 0 (a row that never had a
                gradient stays exactly 0) and the block's largest element restored exactly.
  second moment (exp_avg_sq, max_exp_avg_sq, ...) s = sqrt(v) coded with the unsigned map, which has NO
                ZERO level (1e-8 .. 1 at 8 bits, 1e-4 .. 1 at 4 bits), restored v̂ = ŝ². A nonzero v is
                never restored as 0 (which would make AdamW's m / (sqrt(v) + eps) explode) unless ŝ² underflows
                fp32: a block whose largest v is below ~1e-29 (8-bit) or ~1e-37 (4-bit). A block of zeros is
                restored as zeros. An s below the smallest level is restored at that level: v is over- rather
                than underestimated down there.

Rounding (the entry's ``"stochastic"``): stochastic by default, as the linear code's: x / A goes to one of
the two levels around it, the upper with probability its place between them, drawn from the codec's seed
(per piece and step: FrozenState.seed_for) by the counter-based uniforms of slimfit/kernels/rng.py, so an
encode is deterministic given the step and piece. It is unbiased (E[x̂] = x up to 2**-24 of the gap): under
compress_all, where every moment is decoded, stepped and encoded again at every step, a moment that changes
by less than half a gap per step still follows (a v decaying by beta2 = 0.999 from 1e-4 of its block's
absmax reaches 6.1e-5 after 500 steps, exactly 6.06e-5; nearest rounding holds it at 1e-4:
tests/optim/test_scheduler_state_code.py). ``stochastic=False`` rounds to the nearest level (a tie to the
lower one), as bitsandbytes and torchao do; an entry without the key was written so and its pieces stay so.
Bounds, per element of a block with largest magnitude A (of m, or of s): |x̂ - x| <= A * (the gap between the
two levels around x / A; half of it rounding to nearest), plus a few fp32 ulps of A; below the smallest
nonzero level, x̂ is that level times A or 0 (the signed map's zero; a stochastic draw picks either). One
encode's error is larger stochastic than nearest (the table below), the price of no drift across encodes.

Measured by ``python -m bench.codec_error`` (bench/results/codec_error_cpu.md): AdamW moments of MiniLM-L6
after 100 steps fine-tuning on Rotten Tomatoes, batch 16, lr 5e-5; 22.7M elements, 41% of them in embedding
rows with no gradient yet; block 128; error of AdamW's update u = m̂ / (sqrt(v̂) + eps) at step 100,
bias-corrected, against the exact one. Why sqrt(v) and not v (nearest rounding):

    code                      ||u(v̂)-u|| / ||u||   u(v̂)/u min .. max   share of |u(v̂)/u| > 1.5   < 0.5
    linear 8-bit (sqrt, floor) 0.036 stochastic      0.001 .. 1.96       (nearest: 0.029)
    dynamic 8-bit on v         0.0140                0.039 .. 2.29       9.5e-5                    1.6e-5
    dynamic 8-bit on sqrt(v)   0.0105                0.826 .. 1.35       0                         0
    dynamic 4-bit on v         0.215                 0.000 .. 2.35       4.0e-2                    5.6e-3
    dynamic 4-bit on sqrt(v)   0.196                 0.039 .. 5.48       2.8e-2                    1.6e-5
    linear-no-zero 4-bit, v    0.446 (sqrt(v): 0.211)

sqrt(v) halves the decades a block spans, so fewer small v fall below the map's smallest level (on v
itself they are restored up to 25x too large: the update shrinks by as much); at 8 bits every update is
within 0.83x .. 1.35x of the exact one. At 4 bits sqrt(v) is better in the mean and in almost every
quantile, with a thin tail (4e-5 of the elements) whose update grows more than 4x (an s just below the
midpoint of the two smallest levels 1e-4 and 1e-3 restored at 1e-4). The first moment: the signed map's
m̂ makes ||u(m̂)-u|| / ||u|| = 0.0185 at 8 bits (block 128; 0.021 at 256), 0.26 at 4 bits, against 0.90
for the linear 8-bit code with stochastic rounding (0.37 nearest): a linear step restores the many tiny m
of a block next to a large one as noise, the dynamic map keeps their scale.

The two roundings, one round trip (u(m̂), u(v̂)) and both moments held in the code through the 100 steps,
decoded, updated from the run's gradients and encoded again at every step as compress_all holds them
("held": the update's error, and its norm over the exact one's):

    code                      rounding     u(m̂) err  u(v̂) err  u(v̂)/u min .. max   held err  held |u|
    linear 8-bit              stochastic   0.90       0.036      0.001 .. 1.96        0.119     1.008
                              nearest      0.37       0.029      0.002 .. 1.98        0.103     1.002
    dynamic 8-bit on sqrt(v)  stochastic   0.026      0.0148     0.59 .. 1.45         0.074     1.004
                              nearest      0.0185     0.0105     0.83 .. 1.35         0.052     1.002
    dynamic 4-bit on sqrt(v)  stochastic   0.40       0.286      0.039 .. 9.65        1.27      1.67
                              nearest      0.26       0.196      0.039 .. 5.48        0.70      1.15

Over these 100 steps stochastic rounding's larger error per encode outweighs nearest's drift (a v decays by
at most 0.999^100 = 0.905 in that time), and at 4 bits it inflates the update on average (held |u| 1.67):
an s drawn between levels up to a decade apart is unbiased, 1 / s is not (E[1 / ŝ] > 1 / s). Nearest
rounding's drift shows over longer runs of slowly changing moments (the 500-step decay above). Which
rounding the codec should hold moments with under compress_all is for accuracy runs to settle
(docs/fidelity.md); ``stochastic`` chooses.

Bytes: ceil(numel * bits / 8) (codes) + 4 * ceil(numel / group_size) (absmax): at block 128, 8-bit is 3.88x
smaller than fp32, 4-bit 7.53x.
"""
from __future__ import annotations

import math

import torch

from slimfit.kernels import qmaps
from slimfit.kernels.validation import BLOCKWISE_BLOCK_SIZES

__all__ = ["BITS", "encode", "restore", "zeros", "nbytes", "code_slice", "quantized", "rounds_stochastically"]

BITS = (8, 4)


def check(group_size: int, bits: int) -> None:
    """The block size and code width of a dynamic entry (ValueError naming the choices)."""
    if bits not in BITS:
        raise ValueError(f"codec: the dynamic code has 8 or 4 bits, got {bits!r}")
    if group_size not in BLOCKWISE_BLOCK_SIZES:
        raise ValueError(f"codec: the dynamic code's block size (group_size) must be one of {BLOCKWISE_BLOCK_SIZES}, "
                         f"got {group_size!r}")


def nbytes(numel: int, group_size: int, bits: int) -> int:
    """Bytes of one entry: packed codes plus one fp32 absmax per block."""
    return -(-numel * bits // 8) + 4 * (-(-numel // group_size))


def _map(sqrt: bool, bits: int, like: torch.Tensor) -> torch.Tensor:
    return qmaps.on_device("unsigned" if sqrt else "signed", bits, like)


def make_maps(optimizer, bits: int) -> list[torch.Tensor]:
    """The maps of both moments made on every device of ``optimizer``'s parameters now, not inside the first
    optimizer step: a step's measured peak (slimfit.memory) is then the same for the first step run in a
    process and for any later one, as the planner predicts it. Real maps stay cached for the run (a few KB);
    the caller holds the returned list, which keeps a planned (fake) step's maps alive as long as it."""
    return [_map(sqrt, bits, device_of)
            for device_of in {p.device: p for g in optimizer.param_groups for p in g["params"]}.values()
            for sqrt in (False, True)]


def rounds_stochastically(entry: dict) -> bool:
    """Whether the entry's codes were drawn by stochastic rounding (and its pieces are encoded so again); an
    entry without the key was written by the nearest rounding, which was the only one then."""
    return bool(entry.get("stochastic", False))


def quantized(t: torch.Tensor, sqrt: bool, group_size: int, bits: int, stochastic: bool = False,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, absmax) of ``t`` (its square root for a second moment), rounded to the nearest level or
    stochastically from ``seed``. Temporaries: an fp32 sqrt copy."""
    x = t.detach()
    if sqrt:
        x = x.float().clamp_min(0).sqrt_()   # v >= 0 by construction; clamp keeps a stray -0.0 or -tiny out of NaN
    return torch.ops.slimfit.quantize_blockwise(x, _map(sqrt, bits, x), group_size, bool(stochastic), int(seed))


def _entry(codes, absmax, shape, dtype, sqrt: bool, group_size: int, bits: int, stochastic: bool) -> dict:
    return {"codes": codes, "absmax": absmax, "shape": tuple(int(s) for s in shape), "dtype": dtype,
            "group_size": int(group_size), "sqrt": bool(sqrt), "dynamic": True, "bits": int(bits),
            "stochastic": bool(stochastic)}


def encode(t: torch.Tensor, sqrt: bool, group_size: int, bits: int, stochastic: bool = False, seed: int = 0) -> dict:
    check(group_size, bits)
    codes, absmax = quantized(t, sqrt, group_size, bits, stochastic, seed)
    return _entry(codes, absmax, t.shape, t.dtype, sqrt, group_size, bits, stochastic)


def restore(entry: dict, codes, absmax, shape: tuple, device) -> torch.Tensor:
    """Codes with their blocks' maxima restored to the entry's moment (squared for a second moment), in the
    entry's dtype. Codes cast to a float dtype by a plain ``Optimizer.load_state_dict`` are read back."""
    codes = codes.to(device=device, dtype=torch.uint8)
    absmax = absmax.to(device=device, dtype=torch.float32)
    sqrt, bits = bool(entry["sqrt"]), int(entry["bits"])
    x = torch.ops.slimfit.dequantize_blockwise(codes, absmax, _map(sqrt, bits, codes), int(entry["group_size"]),
                                               list(shape), torch.float32)
    if sqrt:
        x.square_()
    return x.to(entry["dtype"])


def code_slice(entry: dict, start: int, end: int) -> slice:
    """The bytes of the codes of elements [start, end) (start at a block boundary, so at a byte boundary)."""
    bits = int(entry["bits"])
    return slice(start * bits // 8, -(-end * bits // 8))


def zeros(shape, dtype: torch.dtype, device, sqrt: bool, group_size: int, bits: int, stochastic: bool = False) -> dict:
    """The entry encode gives an all-zero moment, made without the moment: every code the one of y = 0 (the
    signed map's zero level; the unsigned map's smallest, times absmax 0), the unused high bits of a last
    half-filled byte zero, every absmax 0. Either rounding gives these codes: y = 0 is a level of the signed
    map, and lies below every level of the unsigned one."""
    check(group_size, bits)
    numel = math.prod(int(s) for s in shape)
    zero = qmaps.code_of_zero("unsigned" if sqrt else "signed", bits)
    byte = zero | (zero << 4) if bits == 4 else zero
    codes = torch.full((nbytes(numel, group_size, bits) - 4 * (-(-numel // group_size)),), byte, dtype=torch.uint8,
                       device=device)
    if bits == 4 and numel % 2:
        codes[-1] = zero
    absmax = torch.zeros(-(-numel // group_size), dtype=torch.float32, device=device)
    return _entry(codes, absmax, shape, dtype, sqrt, group_size, bits, stochastic)
