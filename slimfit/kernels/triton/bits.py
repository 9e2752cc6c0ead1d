"""Bit masks packed 8 per byte (little-endian within a byte), in Triton.

pack_bits: element i of the flattened mask is bit i % 8 of byte i // 8; the unused high
bits of the last byte are zero. A program packs BLOCK_BYTES bytes from a
[BLOCK_BYTES, 8] tile (8 * BLOCK_BYTES contiguous mask bytes, vectorised loads).
unpack_bits: the inverse, written as uint8 0/1 and viewed as bool on the host.
"""

import torch
import triton
import triton.language as tl

from ._common import on_device

BLOCK_BYTES = 1024
NUM_WARPS = 4


@triton.jit
def _pack_bits_kernel(
    mask_ptr, out_ptr,
    n_elements, n_bytes,
    BLOCK_BYTES: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    byte = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)                   # [B] int64
    bit = tl.arange(0, 8)
    idx = byte[:, None] * 8 + bit[None, :]                                  # [B, 8]
    v = tl.load(mask_ptr + idx, mask=idx < n_elements, other=0).to(tl.int32)
    packed = tl.sum(v << bit[None, :], axis=1) & 0xFF   # same bits as the reference's int64 sum
    tl.store(out_ptr + byte, packed.to(tl.uint8), mask=byte < n_bytes)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    n = mask.numel()
    n_bytes = (n + 7) // 8
    out = torch.empty(n_bytes, dtype=torch.uint8, device=mask.device)
    if n == 0:
        return out
    flat = mask.contiguous().view(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    elif flat.dtype != torch.uint8:
        # Non-bool masks: the reference sums (v << j) in int64 and keeps the low byte,
        # which only depends on v mod 256.
        flat = (flat.to(torch.int64) & 0xFF).to(torch.uint8)
    grid = (triton.cdiv(n_bytes, BLOCK_BYTES),)
    with on_device(out):
        _pack_bits_kernel[grid](
            flat, out,
            n, n_bytes,
            BLOCK_BYTES=BLOCK_BYTES, num_warps=NUM_WARPS, enable_fp_fusion=False,
        )
    return out


@triton.jit
def _unpack_bits_kernel(
    packed_ptr, out_ptr,
    n_elements, n_bytes,
    BLOCK_BYTES: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    byte = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    bit = tl.arange(0, 8)
    packed = tl.load(packed_ptr + byte, mask=byte < n_bytes, other=0).to(tl.int32)
    v = (packed[:, None] >> bit[None, :]) & 1
    idx = byte[:, None] * 8 + bit[None, :]
    tl.store(out_ptr + idx, v.to(tl.uint8), mask=idx < n_elements)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    numel = int(numel)
    if numel < 0:
        raise ValueError(f"slimfit.unpack_bits: numel must be >= 0, got {numel}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"slimfit.unpack_bits: packed must be uint8, got {packed.dtype}")
    if numel > packed.numel() * 8:
        raise ValueError(
            f"slimfit.unpack_bits: {packed.numel()} bytes hold at most {packed.numel() * 8} bits, "
            f"asked for {numel}"
        )
    out = torch.empty(numel, dtype=torch.uint8, device=packed.device)
    if numel == 0:
        return out.view(torch.bool)
    packed = packed.contiguous().view(-1)
    n_bytes = (numel + 7) // 8
    grid = (triton.cdiv(n_bytes, BLOCK_BYTES),)
    with on_device(out):
        _unpack_bits_kernel[grid](
            packed, out,
            numel, n_bytes,
            BLOCK_BYTES=BLOCK_BYTES, num_warps=NUM_WARPS, enable_fp_fusion=False,
        )
    return out.view(torch.bool)
