"""fp32 values rounded to bfloat16 or float16 without bias, in Triton (reference.round_stochastic's formulas).

bfloat16 works on bits alone: one ulp away from zero when the element's word has its low 16 bits below
x's low 16 bits; a NaN gives 0x7FC0 and a value whose nearest rounding overflows its signed infinity, as
the nearest cast does (decided from the bits, so the interpreter's truncating fp32 -> bf16 cast is never
used). float16 takes x's two fp16 neighbours (the nearest, and the next one past x), the upper with
probability (x - lo) / (hi - lo) (IEEE division), drawing the element's uniform. Flat elementwise
kernels: BLOCK elements per program.
"""

import torch
import triton
import triton.language as tl

from ..validation import op_round_stochastic
from . import _rng
from ._common import on_device

BLOCK = 2048
NUM_WARPS = 4


@triton.jit(do_not_specialize=["k0", "k1"])
def _round_bf16_kernel(x_ptr, out_ptr, n_elements, k0, k1, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    inside = idx < n_elements
    b = tl.load(x_ptr + idx, mask=inside, other=0).to(tl.uint32, bitcast=True)   # x's bits (int32 view)
    low16 = tl.full((), 0xFFFF, tl.uint32)
    trunc = b & tl.full((), 0xFFFF0000, tl.uint32)
    w = _rng.random_words(idx, k0, k1)
    up = tl.where((w & low16) < (b & low16), trunc + tl.full((), 0x10000, tl.uint32), trunc)
    mag = b & tl.full((), 0x7FFFFFFF, tl.uint32)
    inf16 = ((b >> 16) & tl.full((), 0x8000, tl.uint32)) | tl.full((), 0x7F80, tl.uint32)
    y = tl.where(mag >= tl.full((), 0x7F7F8000, tl.uint32), inf16, up >> 16)   # nearest overflows (inf too)
    y = tl.where(mag > tl.full((), 0x7F800000, tl.uint32), tl.full((), 0x7FC0, tl.uint32), y)   # NaN
    tl.store(out_ptr + idx, y.to(tl.uint16).to(tl.int16, bitcast=True), mask=inside)


@triton.jit
def fp16_stochastic(x, u):
    """fp32 x rounded to float16 from uniforms u: the upper of its two fp16 neighbours with probability
    (x - lo) / (hi - lo); the nearest where x or its nearest rounding is not finite (the reference's formulas;
    adam_blockwise.py rounds its fp16 weights with it too)."""
    near = x.to(tl.float16)
    nf = near.to(tl.float32)
    h = near.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    toward_up = nf < x
    negative = (h & 0x8000) != 0
    step = tl.where(toward_up != negative, h + 1, h - 1)
    nxt = tl.where((h & 0x7FFF) == 0, tl.where(toward_up, 0x0001, 0x8001), step)
    other = nxt.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    lo = tl.minimum(nf, other)
    hi = tl.maximum(nf, other)
    p = tl.math.div_rn(x - lo, hi - lo)
    y = tl.where(u < p, hi, lo).to(tl.float16)
    finite = (tl.abs(x) < float("inf")) & (tl.abs(nf) < float("inf"))   # NaN compares false
    return tl.where(finite, y, near)


@triton.jit(do_not_specialize=["k0", "k1"])
def _round_fp16_kernel(x_ptr, out_ptr, n_elements, k0, k1, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    inside = idx < n_elements
    x = tl.load(x_ptr + idx, mask=inside, other=0.0)
    tl.store(out_ptr + idx, fp16_stochastic(x, _rng.uniform(idx, k0, k1)), mask=inside)


def round_stochastic(x: torch.Tensor, dtype: torch.dtype, seed: int) -> torch.Tensor:
    op_round_stochastic(x, dtype, seed)
    x = x.contiguous()
    n = x.numel()
    if dtype == torch.bfloat16:
        out = torch.empty(x.shape, dtype=torch.int16, device=x.device)
    else:
        out = torch.empty(x.shape, dtype=torch.float16, device=x.device)
    if n:
        k0, k1 = _rng.seed_key_args(seed)
        grid = (triton.cdiv(n, BLOCK),)
        kernel = _round_bf16_kernel if dtype == torch.bfloat16 else _round_fp16_kernel
        src = x.view(-1).view(torch.int32) if dtype == torch.bfloat16 else x.view(-1)
        with on_device(x):
            kernel[grid](src, out.view(-1), n, k0, k1, BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out.view(torch.bfloat16) if dtype == torch.bfloat16 else out
