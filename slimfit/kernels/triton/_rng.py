"""The counter-based hash of `slimfit.kernels.rng` in Triton (uint32 arithmetic).

word(i) = lowbias32(lowbias32(lo32(i) ^ k0) ^ hi32(i) ^ k1)
uniform(i) = (word(i) >> 8) * 2**-24

Python int constants above 2**31 - 1 would become int64 inside a kernel, so every
constant here is materialised as a uint32 scalar with `tl.full`; products of two
uint32 values wrap modulo 2**32 exactly like the `& MASK32` of the reference.
The seed keys are computed on the host (`seed_key_args`) and passed as int32 kernel
arguments holding the same 32 bits, then bitcast back to uint32 in the kernel.
"""

import triton
import triton.language as tl

from .. import rng


def _as_int32(v: int) -> int:
    """A uint32 value as the int32 with the same bits (always an i32 kernel argument)."""
    v &= rng.MASK32
    return v - (1 << 32) if v >= (1 << 31) else v


def seed_key_args(seed: int) -> tuple[int, int]:
    """(k0, k1) of `rng.seed_keys`, as int32 kernel arguments."""
    k0, k1 = rng.seed_keys(seed)
    return _as_int32(k0), _as_int32(k1)


@triton.jit
def lowbias32(x):
    """The lowbias32 mixer on a uint32 tensor."""
    mul1 = tl.full((), 0x7FEB352D, tl.uint32)
    mul2 = tl.full((), 0x846CA68B, tl.uint32)
    x = x ^ (x >> 16)
    x = x * mul1
    x = x ^ (x >> 15)
    x = x * mul2
    x = x ^ (x >> 16)
    return x


@triton.jit
def random_words(idx, k0, k1):
    """uint32 random words for int64 element indices `idx`; k0, k1: int32 seed keys."""
    k0u = k0.to(tl.uint32, bitcast=True)
    k1u = k1.to(tl.uint32, bitcast=True)
    lo = (idx & 0xFFFFFFFF).to(tl.uint32)
    hi = (idx >> 32).to(tl.uint32)
    return lowbias32(lowbias32(lo ^ k0u) ^ hi ^ k1u)


@triton.jit
def uniform(idx, k0, k1):
    """fp32 uniforms in [0, 1) on the 2**-24 grid, bit-identical to `rng.uniform`."""
    w = random_words(idx, k0, k1)
    return (w >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24, exact


@triton.jit
def uniform_hoisted(lo, hk1, k0):
    """`uniform` with the index's high half folded into the key once per program:
    lo = low 32 bits of the element index (uint32), hk1 = hi32(index) ^ k1 (a uint32 scalar).
    Valid when a program's elements share hi32(index): blocks aligned to a power of two <= 2**32."""
    k0u = k0.to(tl.uint32, bitcast=True)
    w = lowbias32(lowbias32(lo ^ k0u) ^ hk1)
    return (w >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24, exact
