"""Block-wise dynamic quantization (slimfit::quantize_blockwise, 4- or 8-bit codes of a map) and its
inverse, in Triton.

One program handles BLOCKS consecutive blocks (TILE = BLOCKS * BLOCK_SIZE, about TILE_ELEMS elements),
seen as a [BLOCKS, BLOCK_SIZE] tile: element (b, j) of program `pid` is flat index
    pid * TILE + b * BLOCK_SIZE + j.
Per block: absmax = max |x| (NaN-propagating reduction), one IEEE reciprocal (`div_rn`), y = x * inv; the
code is the count of the map's midpoints below y, found by a binary search of BITS steps, each a gather
from the midpoint table (255 fp32 values: it stays in L1). Codes are packed PER = 8 // BITS to a byte as
quantize.py packs them (its `_store_packed_codes`). Dequantize gathers qmap[code] and multiplies by the
block's absmax.

Bit-exactness with `reference.quantize_blockwise` / `reference.dequantize_blockwise`: fp32 throughout,
the same operation order, IEEE division for the reciprocal, launches with `enable_fp_fusion=False`; the
midpoints are computed by the launcher with torch ((qmap[:-1] + qmap[1:]) * 0.5: two IEEE operations,
the reference's formula).
"""

import math

import torch
import triton
import triton.language as tl

from ..validation import blockwise_bits, num_groups, op_dequantize_blockwise, op_quantize_blockwise, packed_code_bytes
from . import _rng
from ._common import on_device
from .quantize import _nan_max, _store_packed_codes

TILE_ELEMS = 4096   # elements per program (as quantize.py): 16 blocks of 256, one of 4096
NUM_WARPS = 8
MIN_NORMAL = tl.constexpr(1.1754943508222875e-38)  # 2**-126: a smaller absmax codes every y as 0


def blocks_per_program(block_size: int, nb: int) -> int:
    g = max(1, TILE_ELEMS // block_size)
    return min(g, triton.next_power_of_2(max(nb, 1)))   # a small tensor: no tile far larger than it


def kernel_signature(x_type: str) -> dict:
    """Triton signature of `_quantize_blockwise_kernel` for an input of pointer type x_type ('*fp32', ...)
    (bench/kernels_static.py compiles it for sm_90a)."""
    return {"x_ptr": x_type, "mid_ptr": "*fp32", "codes_ptr": "*u8", "absmax_ptr": "*fp32", "n_elements": "i32",
            "n_blocks": "i32", "n_bytes": "i32", "BITS": "constexpr", "BLOCK_SIZE": "constexpr", "BLOCKS": "constexpr"}


def stochastic_kernel_signature(x_type: str) -> dict:
    """Triton signature of `_quantize_blockwise_stochastic_kernel` for an input of pointer type x_type."""
    return {"x_ptr": x_type, "qmap_ptr": "*fp32", "gaps_ptr": "*fp32", "codes_ptr": "*u8", "absmax_ptr": "*fp32",
            "n_elements": "i32", "n_blocks": "i32", "n_bytes": "i32", "k0": "i32", "k1": "i32", "BITS": "constexpr",
            "BLOCK_SIZE": "constexpr", "BLOCKS": "constexpr"}


def dequantize_signature(out_type: str) -> dict:
    return {"codes_ptr": "*u8", "absmax_ptr": "*fp32", "qmap_ptr": "*fp32", "out_ptr": out_type, "n_elements": "i32",
            "n_blocks": "i32", "n_bytes": "i32", "BITS": "constexpr", "BLOCK_SIZE": "constexpr", "BLOCKS": "constexpr"}


@triton.jit
def _nearest_code(y, mid_ptr, BITS: tl.constexpr):
    """The count of midpoints below y (the nearest level; a tie to the lower one; NaN -> 0)."""
    c = tl.zeros(y.shape, tl.int32)
    for i in tl.static_range(BITS):
        h = (1 << (BITS - 1)) >> i
        m = tl.load(mid_ptr + c + (h - 1))
        c = tl.where(m < y, c + h, c)
    return c


@triton.jit
def _stochastic_code(y, qmap_ptr, gaps_ptr, u, BITS: tl.constexpr):
    """c = #{k >= 1 : qmap[k] <= y} (the level at or below y; 0 below the first and for NaN), then c + 1 when
    u < (y - qmap[c]) * g[c] (NaN compares false; g = 0 at the top level)."""
    c = tl.zeros(y.shape, tl.int32)
    for i in tl.static_range(BITS):
        h = (1 << (BITS - 1)) >> i
        m = tl.load(qmap_ptr + c + h)           # qmap[1 + (c + h - 1)]
        c = tl.where(m <= y, c + h, c)
    t = (y - tl.load(qmap_ptr + c)) * tl.load(gaps_ptr + c)
    return tl.where(u < t, c + 1, c)


@triton.jit
def _load_scaled_blocks(x_ptr, absmax_ptr, pid, n_elements, n_blocks,
                        BLOCK_SIZE: tl.constexpr, BLOCKS: tl.constexpr):
    """(y, offs, valid) of program pid's [BLOCKS, BLOCK_SIZE] tile, y = x * (1 / absmax of its block); stores
    the blocks' absmax."""
    TILE: tl.constexpr = BLOCKS * BLOCK_SIZE
    base = pid * TILE
    offs = tl.arange(0, BLOCKS)[:, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]   # [B, S] int32
    valid = offs < n_elements - base
    x = tl.load(x_ptr + base + offs, mask=valid, other=0.0).to(tl.float32)
    absmax = tl.reduce(tl.abs(x), 1, _nan_max)                                            # [B]
    # zero, subnormal and non-finite blocks (NaN compares false, 1 / inf = 0): every y is 0 (or NaN)
    normal = absmax >= MIN_NORMAL
    inv = tl.where(normal, tl.math.div_rn(tl.full((), 1.0, tl.float32), tl.where(normal, absmax, 1.0)), 0.0)
    block = pid * BLOCKS + tl.arange(0, BLOCKS)
    tl.store(absmax_ptr + block, absmax, mask=block < n_blocks)
    return x * inv[:, None], offs, valid


@triton.jit
def _quantize_blockwise_kernel(
    x_ptr, mid_ptr, codes_ptr, absmax_ptr,
    n_elements, n_blocks, n_bytes,
    BITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCKS: tl.constexpr,
):
    TILE: tl.constexpr = BLOCKS * BLOCK_SIZE
    pid = tl.program_id(0).to(tl.int64)
    y, offs, valid = _load_scaled_blocks(x_ptr, absmax_ptr, pid, n_elements, n_blocks, BLOCK_SIZE, BLOCKS)
    c = _nearest_code(y, mid_ptr, BITS)
    c = tl.where(valid, c, 0)                                                             # unused high bits: 0
    _store_packed_codes(codes_ptr, c, pid, offs, n_bytes, BITS, TILE, False)


@triton.jit(do_not_specialize=["k0", "k1"])
def _quantize_blockwise_stochastic_kernel(
    x_ptr, qmap_ptr, gaps_ptr, codes_ptr, absmax_ptr,
    n_elements, n_blocks, n_bytes, k0, k1,
    BITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCKS: tl.constexpr,
):
    TILE: tl.constexpr = BLOCKS * BLOCK_SIZE
    pid = tl.program_id(0).to(tl.int64)
    y, offs, valid = _load_scaled_blocks(x_ptr, absmax_ptr, pid, n_elements, n_blocks, BLOCK_SIZE, BLOCKS)
    base = pid * TILE
    lo = (base + offs).to(tl.uint32)                                                      # low 32 bits of the index
    hk1 = (base >> 32).to(tl.uint32) ^ k1.to(tl.uint32, bitcast=True)
    c = _stochastic_code(y, qmap_ptr, gaps_ptr, _rng.uniform_hoisted(lo, hk1, k0), BITS)
    c = tl.where(valid, c, 0)                                                             # unused high bits: 0
    _store_packed_codes(codes_ptr, c, pid, offs, n_bytes, BITS, TILE, False)


def _cached_table(qmap: torch.Tensor, attr: str, make) -> torch.Tensor:
    """make(qmap) kept on the map object under ``attr`` until the map is modified in place (its version
    counter), so the codec's cached maps cost no launch."""
    version = getattr(qmap, "_version", None) if not torch.is_inference(qmap) else None
    cached = getattr(qmap, attr, None)
    if version is not None and cached is not None and cached[0] == version:
        return cached[1]
    table = make(qmap.reshape(-1)).contiguous()
    if version is not None:
        setattr(qmap, attr, (version, table))
    return table


def midpoints(qmap: torch.Tensor) -> torch.Tensor:
    """(qmap[i] + qmap[i + 1]) * 0.5 in fp32, on qmap's device (the reference's formula), cached."""
    return _cached_table(qmap, "_slimfit_mid", lambda q: (q[:-1] + q[1:]) * 0.5)


def inverse_gaps(qmap: torch.Tensor) -> torch.Tensor:
    """1 / (qmap[k + 1] - qmap[k]) in fp32 and a last 0, on qmap's device (the reference's formula), cached."""
    return _cached_table(qmap, "_slimfit_gaps", lambda q: torch.cat([1.0 / (q[1:] - q[:-1]), q.new_zeros(1)]))


def quantize_blockwise(x: torch.Tensor, qmap: torch.Tensor, block_size: int, stochastic: bool = False,
                       seed: int = 0):
    op_quantize_blockwise(x, qmap, block_size, stochastic, seed)
    n = x.numel()
    bits = blockwise_bits(qmap)
    nb = num_groups(n, block_size)
    nbytes = packed_code_bytes(n, bits)
    codes = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    absmax = torch.empty(nb, dtype=torch.float32, device=x.device)
    if n == 0:
        return codes, absmax
    x = x.contiguous().view(-1)
    blocks = blocks_per_program(block_size, nb)
    grid = (triton.cdiv(nb, blocks),)
    shape = dict(BITS=bits, BLOCK_SIZE=block_size, BLOCKS=blocks, num_warps=NUM_WARPS, enable_fp_fusion=False)
    with on_device(x):
        if stochastic:
            k0, k1 = _rng.seed_key_args(seed)
            _quantize_blockwise_stochastic_kernel[grid](
                x, qmap.contiguous(), inverse_gaps(qmap), codes, absmax, n, nb, nbytes, k0, k1, **shape)
        else:
            _quantize_blockwise_kernel[grid](x, midpoints(qmap), codes, absmax, n, nb, nbytes, **shape)
    return codes, absmax


@triton.jit
def _dequantize_blockwise_kernel(
    codes_ptr, absmax_ptr, qmap_ptr, out_ptr,
    n_elements, n_blocks, n_bytes,
    BITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCKS: tl.constexpr,
):
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    TILE: tl.constexpr = BLOCKS * BLOCK_SIZE
    pid = tl.program_id(0).to(tl.int64)
    byte = pid * (TILE // PER) + tl.arange(0, TILE // PER)
    packed = tl.load(codes_ptr + byte, mask=byte < n_bytes, other=0).to(tl.int32)
    code = (packed[:, None] >> (tl.arange(0, PER) * BITS)[None, :]) & MASK                 # [TILE / PER, PER]
    code = tl.reshape(code, [BLOCKS, BLOCK_SIZE])
    level = tl.load(qmap_ptr + code)
    block = pid * BLOCKS + tl.arange(0, BLOCKS)
    absmax = tl.load(absmax_ptr + block, mask=block < n_blocks, other=0.0)
    y = level * absmax[:, None]
    idx = block[:, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]
    tl.store(out_ptr + idx, y.to(out_ptr.dtype.element_ty), mask=idx < n_elements)


_KERNEL_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dequantize_blockwise(codes, absmax, qmap, block_size: int, shape, dtype):
    op_dequantize_blockwise(codes, absmax, qmap, block_size, shape, dtype)   # the sizes, before any allocation
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=codes.device)
    bits = blockwise_bits(qmap)
    nb = num_groups(n, block_size)
    kernel_dtype = dtype if dtype in _KERNEL_OUT_DTYPES else torch.float32
    out = torch.empty(shape, dtype=kernel_dtype, device=codes.device)
    blocks = blocks_per_program(block_size, nb)
    with on_device(out):
        _dequantize_blockwise_kernel[(triton.cdiv(nb, blocks),)](
            codes.contiguous().view(-1), absmax.contiguous().view(-1), qmap.contiguous(), out,
            n, nb, packed_code_bytes(n, bits),
            BITS=bits, BLOCK_SIZE=block_size, BLOCKS=blocks,
            num_warps=NUM_WARPS, enable_fp_fusion=False,
        )
    # float64: one exact fp32 -> float64 cast, as the reference does
    return out if kernel_dtype == dtype else out.to(dtype)
