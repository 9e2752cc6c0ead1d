"""Seeded dropout whose mask is regenerated from (seed, element index), in Triton.

keep(i) = rng.uniform(seed, i) >= float32(p), the same counter-based hash as the reference.
dropout_mask writes the keep mask (uint8 0/1, viewed as bool); seeded_dropout computes
y = x * float32(1 / (1 - p)) where kept, else 0, in fp32, cast back to x's dtype.
Flat elementwise kernels: BLOCK elements per program, cdiv(numel, BLOCK) programs.
"""

import torch
import triton
import triton.language as tl

from ..validation import check_dropout_p
from . import _rng
from ._common import fp32, on_device

BLOCK = 2048
NUM_WARPS = 4


@triton.jit(do_not_specialize=["k0", "k1"])
def _dropout_mask_kernel(
    out_ptr,
    n_elements, p,
    k0, k1,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    keep = _rng.uniform(idx, k0, k1) >= p
    tl.store(out_ptr + idx, keep.to(tl.uint8), mask=idx < n_elements)


def dropout_mask(like: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    check_dropout_p(p)  # any int64 seed, read as unsigned 64-bit (the op's contract, as the reference)
    out = torch.empty(like.shape, dtype=torch.uint8, device=like.device)
    n = out.numel()
    if n == 0:
        return out.view(torch.bool)
    k0, k1 = _rng.seed_key_args(seed)
    grid = (triton.cdiv(n, BLOCK),)
    with on_device(out):
        _dropout_mask_kernel[grid](
            out,
            n, fp32(p),  # the reference compares fp32 u with p cast to fp32
            k0, k1,
            BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False,
        )
    return out.view(torch.bool)


@triton.jit(do_not_specialize=["k0", "k1"])
def _seeded_dropout_kernel(
    x_ptr, out_ptr,
    n_elements, p, factor,
    k0, k1,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    inside = idx < n_elements
    x = tl.load(x_ptr + idx, mask=inside, other=0.0).to(tl.float32)
    keep = _rng.uniform(idx, k0, k1) >= p
    y = tl.where(keep, x * factor, 0.0)
    tl.store(out_ptr + idx, y.to(out_ptr.dtype.element_ty), mask=inside)


def seeded_dropout(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    check_dropout_p(p)
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise TypeError(
            f"slimfit.seeded_dropout: unsupported dtype {x.dtype}; use float32, float16 or bfloat16"
        )
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x.numel()
    if p >= 1.0:
        return out.zero_()
    if n == 0:
        return out
    k0, k1 = _rng.seed_key_args(seed)
    grid = (triton.cdiv(n, BLOCK),)
    with on_device(x):
        _seeded_dropout_kernel[grid](
            x.contiguous().view(-1), out,
            n, fp32(p), fp32(1.0 / (1.0 - p)),  # factor: float32(1 / (1 - p)) as the reference
            k0, k1,
            BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False,
        )
    return out
