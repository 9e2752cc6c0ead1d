"""Counter-based random numbers shared by every backend.

A random 32-bit word is a pure function of (seed, element index), so a forward
and its backward regenerate the same stream, and the reference, C++ and Triton
backends produce identical bits. The mixer is the `lowbias32` integer hash;
two rounds separate the low and high halves of the 64-bit index.

    k0, k1 = seed_keys(seed)
    word(i) = lowbias32(lowbias32(lo32(i) ^ k0) ^ hi32(i) ^ k1)
    uniform(i) = (word(i) >> 8) * 2**-24        # in [0, 1), 24 bits
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MUL1 = 0x7FEB352D
MUL2 = 0x846CA68B
SEED_SALT0 = 0x243F6A88
SEED_SALT1 = 0x85A308D3
INV_2_24 = 1.0 / (1 << 24)


def lowbias32_int(x: int) -> int:
    """The hash on one Python int (host side: seed keys)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * MUL1) & MASK32
    x ^= x >> 15
    x = (x * MUL2) & MASK32
    x ^= x >> 16
    return x


def seed_keys(seed: int) -> tuple[int, int]:
    """Two 32-bit keys derived from a 64-bit seed."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    k0 = lowbias32_int((seed & MASK32) ^ SEED_SALT0)
    k1 = lowbias32_int((seed >> 32) ^ SEED_SALT1 ^ k0)
    return k0, k1


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """The hash on an int64 tensor holding uint32 values (products wrap; the mask keeps 32 bits)."""
    x = x ^ (x >> 16)
    x = (x * MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MUL2) & MASK32
    x = x ^ (x >> 16)
    return x


def random_words(seed: int, numel: int, device, start: int = 0) -> torch.Tensor:
    """uint32 words (as int64) for element indices start..start+numel-1."""
    k0, k1 = seed_keys(seed)
    idx = torch.arange(start, start + numel, dtype=torch.int64, device=device)
    lo = idx & MASK32
    hi = idx >> 32
    return lowbias32(lowbias32(lo ^ k0) ^ hi ^ k1)


def uniform(seed: int, numel: int, device, start: int = 0) -> torch.Tensor:
    """fp32 uniforms in [0, 1) on a 2**-24 grid, for element indices start..start+numel-1."""
    return (random_words(seed, numel, device, start) >> 8).to(torch.float32) * INV_2_24
