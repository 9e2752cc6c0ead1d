"""One Adam/AdamW step of pieces whose moments are 8- or 4-bit block-wise dynamic codes (slimfit::adam_blockwise_),
in Triton: decode both moments, step, write the weight, encode the moments again, in one kernel; with a score
kind, also each block's sums of the scheduler's score of the move (SCORE, the row's sums address; 0: none).
4-bit codes (BITS 4) sit two to a byte, element 2i in the low half of byte i: a tile's codes are loaded a byte
per element and shifted, and stored as pairs (the tile reshaped to [BLOCKS, BLOCK_SIZE / 2, 2] and split).

Launches: one per group of the call's non-empty pieces that share (weight dtype, gradient dtype), however many
pieces a group holds (the multi-tensor-apply pattern: a held step of hundreds of small biases and norm weights
is a handful of launches, not hundreds). The host builds one int64 table per call, copied to the device once
(from pinned memory, without waiting):

  * a row of FIELDS entries per non-empty piece: the data addresses (`data_ptr()`) of its weight, gradient,
    m codes, m maxima, v codes and v maxima, its element count, its random-index offset, the bits of its fp32
    scalars (step size, decay, sqrt of the second bias correction) and its three pairs of seed keys (k0 in the
    low, k1 in the high 32 bits);
  * after the rows, per group, a work list of two entries per program: (the piece's row, the piece's first
    block the program handles).

A program reads its work entry and its piece's row, casts the addresses to typed pointers (the weight's and
gradient's element types are the group's, constexpr) and handles BLOCKS consecutive whole blocks of that piece
(TILE = BLOCKS * BLOCK_SIZE, about TILE_ELEMS elements; a piece's last program may be partial, masked by the
piece's element count) as a [BLOCKS, BLOCK_SIZE] tile, as quantize_blockwise.py does: element (b, k) of a
program whose first block is f is the piece's element (f + b) * BLOCK_SIZE + k, so the absmax of a block of the
new m and of s = sqrt(max(v, 0)) is a reduction over the tile's last axis, and every byte of codes, block
maxima and weights is read and written by one program only (in place is safe). BLOCKS is the group's:
blocks_per_program of its largest piece (a group of small pieces gets small tiles).

The addresses are the tensors' own: a piece may start anywhere in its parameter (a bf16 weight at an odd
element, codes at any byte, maxima at any block), so the compiler can assume nothing of them beyond their
element type's alignment. A launch's ALIGN level says what the launcher found true of every piece of its group
(the kernel tells the compiler so with `tl.multiple_of`):
  ALIGN_ANY   nothing: a thread's elements are loaded one by one; programs of 4 elements a thread (twice the
              warps, at most 16), which keeps their registers near the aligned variants' (64-106 on sm_90 for
              blocks of 128 and 256; a block of 4096 stays at 8 elements a thread: 116-128, some spills);
  ALIGN_PTRS  every weight, gradient and code address 16-byte aligned (the usual case: pieces start at block
              boundaries of aligned tensors): contiguous elements a thread, vector loads where the mask allows;
  ALIGN_ALL   also every element count a multiple of 16: the masks are constant over 16 elements, loads and
              stores of weights, gradients and codes are vectors (16 bytes).
The block maxima are never assumed aligned (a piece's may start at any block).

Bit-exactness with `reference_adam.adam_blockwise_`:
  * score sums: each block's terms summed by halving (the tile reshaped to [BLOCKS, 2, half] and split, LOG2_BLOCK
    times), the reference's order, every addition rounded on its own;
  * fp32 throughout, the reference's operation order, every operation rounded on its own (launches with
    `enable_fp_fusion=False`); IEEE division and square root (`div_rn`, `sqrt_rn`: Triton's `/` and
    `tl.sqrt` are approximate on NVIDIA GPUs);
  * every scalar is rounded to fp32 on the host as the reference rounds it ((1 - beta1) and (1 - beta2)
    in double first), and made an fp32 value in the kernel (`_f32`: the interpreter would otherwise
    widen a Python float below 2**-126 to fp64); the per-piece ones travel as fp32 bits in the table;
  * codes as quantize_blockwise.py makes them (its `_nearest_code` / `_stochastic_code` and tables);
  * random draws at index offsets[j] + i, a full 64-bit index per element: a piece starts anywhere in
    its parameter, so a tile may straddle a multiple of 2**32 (the hoisted hash of quantize_blockwise.py
    assumes aligned tiles);
  * bfloat16 weights are rounded on their bits (nearest even, or round_stochastic.py's formulas), never
    by the interpreter's truncating fp32 -> bf16 cast; float16 weights as round_stochastic.py does. A NaN
    weight stored as bf16 is 0x7FC0 (as round_stochastic.py's): torch's own casts differ in the payload
    (0xFFFF on the CPU's vector path, 0x7FFF on CUDA), which is no part of the op.

Under TRITON_INTERPRET=1 the kernel runs on the host and dereferences the table's addresses there (int64 ->
pointer casts are bitcasts in the interpreter): CPU tensors directly; a call on GPU tensors is stepped on CPU
copies of its tensors, written back afterwards.
"""

import numpy as np
import torch
import triton
import triton.language as tl

from .. import rng
from ..validation import blockwise_bits, num_groups
from . import _rng
from ._common import fp32, on_device
from .quantize import _nan_max
from .quantize_blockwise import MIN_NORMAL, _nearest_code, _stochastic_code, inverse_gaps, midpoints
from .round_stochastic import fp16_stochastic

TILE_ELEMS = 2048   # elements per program: 8 blocks of 256 (fewer live values per thread than quantize's 4096)
NUM_WARPS = 8       # 8 elements a thread: 59-118 registers on sm_90 (ALIGN_ALL), no spills (16 warps for a block
                    # of 4096)

W_FP32, W_BF16, W_FP16 = 0, 1, 2            # the weight's storage (bf16 through an int16 view of its bits)
WD_NONE, WD_L2, WD_DECOUPLED = 0, 1, 2      # no weight decay, Adam's (on the gradient), AdamW's (on the weight)
SCORE_NONE, SCORE_RELATIVE, SCORE_ROBUST, SCORE_ABSOLUTE = 0, 1, 2, 3   # the op's score kinds (reference_adam)
_W_KINDS = {torch.float32: W_FP32, torch.bfloat16: W_BF16, torch.float16: W_FP16}   # the gradient's too

# a piece's row of the table, FIELDS int64 entries: the data addresses of its weight, gradient, m codes, m maxima,
# v codes and v maxima; its element count and the random-index offset of its first element; fp32 bits (in the
# low 32 bits) of its step size, decay and bc2_sqrt; its seed keys k0 | k1 << 32 for the m codes, the v codes
# and the weight's rounding; the address of its (3, blocks) score sums (0: not scored); one spare entry (a row is
# 128 bytes)
F_P, F_G, F_MC, F_MA, F_VC, F_VA = (tl.constexpr(k) for k in range(6))
F_N, F_OFFSET, F_STEP, F_DECAY, F_BC2, F_KM, F_KS, F_KW, F_SUMS = (tl.constexpr(k) for k in range(6, 15))
FIELDS = tl.constexpr(16)
ALIGN_ANY, ALIGN_PTRS, ALIGN_ALL = 0, 1, 2  # what a launch may assume of its pieces (the module docstring)
ALIGN_BYTES = 16                             # bytes of an aligned address (elements of an aligned count)


def blocks_per_program(block_size: int, nb: int) -> int:
    g = max(1, TILE_ELEMS // block_size)
    return min(g, triton.next_power_of_2(max(nb, 1)))   # a small piece: no tile far larger than it


def num_warps(tile: int, align: int = ALIGN_ALL, heavy: bool = False) -> int:
    """Warps of a program of `tile` elements: at most 8 elements a thread (a tile is one block when the block
    is larger than TILE_ELEMS), at most 4 when nothing is known of the addresses (ALIGN_ANY) or the program also
    sums scores or packs 4-bit codes (``heavy``: more live values a thread); at most 16."""
    return max(NUM_WARPS, min(16, tile // (128 if align == ALIGN_ANY or heavy else 256)))


@triton.jit
def _f32(x):
    """x as an fp32 scalar (a Python float in the interpreter, an fp32 argument when compiled)."""
    return tl.full((), x, tl.float32)


@triton.jit
def _u32(x: tl.constexpr):
    return tl.full((), x, tl.uint32)


@triton.jit
def _bf16_bits_nearest(b):
    """bf16 bits (in a uint32) of the fp32 with bits b, rounded to nearest even; NaN -> 0x7FC0 (torch's)."""
    r = (b + _u32(0x7FFF) + ((b >> 16) & _u32(1))) >> 16       # overflow carries into the infinity
    return tl.where((b & _u32(0x7FFFFFFF)) > _u32(0x7F800000), _u32(0x7FC0), r)


@triton.jit
def _bf16_bits_stochastic(b, w):
    """round_stochastic.py's bf16 rounding of the fp32 with bits b, from random words w."""
    trunc = b & _u32(0xFFFF0000)
    up = tl.where((w & _u32(0xFFFF)) < (b & _u32(0xFFFF)), trunc + _u32(0x10000), trunc)
    mag = b & _u32(0x7FFFFFFF)
    inf16 = ((b >> 16) & _u32(0x8000)) | _u32(0x7F80)
    y = tl.where(mag >= _u32(0x7F7F8000), inf16, up >> 16)            # the nearest overflows (inf too)
    return tl.where(mag > _u32(0x7F800000), _u32(0x7FC0), y)           # NaN


@triton.jit
def _encode(x, valid, idx, codes_ptr, absmax_ptr, ptrs, block, bvalid, qmap_ptr, mid_ptr, gaps_ptr, k0, k1,
            STOCHASTIC: tl.constexpr, BITS: tl.constexpr, BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Codes and block maxima of a [BLOCKS, BLOCK_SIZE] tile x (quantize_blockwise's, padding as 0): one code a
    byte (BITS 8), or two (BITS 4: element 2i in the low half of byte i, a padding code as 0)."""
    x = tl.where(valid, x, 0.0)
    absmax = tl.reduce(tl.abs(x), 1, _nan_max)                                            # [B], NaN wins
    normal = absmax >= MIN_NORMAL          # zero, subnormal, NaN: inv = 0; inf: 1 / inf = 0
    inv = tl.where(normal, tl.math.div_rn(tl.full((), 1.0, tl.float32), tl.where(normal, absmax, 1.0)), 0.0)
    y = x * inv[:, None]
    if STOCHASTIC:
        c = _stochastic_code(y, qmap_ptr, gaps_ptr, _rng.uniform(idx, k0, k1), BITS)
    else:
        c = _nearest_code(y, mid_ptr, BITS)
    if BITS == 8:
        tl.store(codes_ptr + ptrs, c.to(tl.uint8), mask=valid)
    else:
        c = tl.where(valid, c, 0)
        lo, hi = tl.split(tl.reshape(c, [BLOCKS, BLOCK_SIZE // 2, 2]))
        lv, _ = tl.split(tl.reshape(valid, [BLOCKS, BLOCK_SIZE // 2, 2]))
        bp, _ = tl.split(tl.reshape(ptrs, [BLOCKS, BLOCK_SIZE // 2, 2]))
        tl.store(codes_ptr + bp // 2, (lo | (hi << 4)).to(tl.uint8), mask=lv)
    tl.store(absmax_ptr + block, absmax, mask=bvalid)


@triton.jit
def _bits_f32(e):
    """The fp32 whose bits are the low 32 bits of the int64 table entry e."""
    return e.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _typed(addr, KIND: tl.constexpr, ALIGN: tl.constexpr):
    """A weight or gradient address as a pointer to its storage (W_FP32, W_BF16 as int16 bits, W_FP16)."""
    if KIND == 0:
        p = addr.to(tl.pointer_type(tl.float32))
    elif KIND == 1:
        p = addr.to(tl.pointer_type(tl.int16))
    else:
        p = addr.to(tl.pointer_type(tl.float16))
    if ALIGN != 0:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _codes(addr, ALIGN: tl.constexpr):
    p = addr.to(tl.pointer_type(tl.uint8))
    if ALIGN != 0:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _work_entry(tab_ptr, work_start):
    """The program's work entry: its piece's row (a pointer into the table) and the piece's first block it handles."""
    work = tab_ptr + work_start + 2 * tl.program_id(0).to(tl.int64)
    row = tab_ptr + tl.load(work) * FIELDS
    first = tl.load(work + 1)
    return row, first


@triton.jit
def _piece_pointers(row, W_KIND: tl.constexpr, G_KIND: tl.constexpr, ALIGN: tl.constexpr):
    """The piece's typed pointers (weight, gradient, m codes, m maxima, v codes, v maxima), its element count and
    the random-index offset of its first element, from its row."""
    p_ptr = _typed(tl.load(row + F_P), W_KIND, ALIGN)
    g_ptr = _typed(tl.load(row + F_G), G_KIND, ALIGN)
    mc_ptr = _codes(tl.load(row + F_MC), ALIGN)
    ma_ptr = tl.load(row + F_MA).to(tl.pointer_type(tl.float32))
    vc_ptr = _codes(tl.load(row + F_VC), ALIGN)
    va_ptr = tl.load(row + F_VA).to(tl.pointer_type(tl.float32))
    n = tl.load(row + F_N)
    if ALIGN == 2:
        n = tl.multiple_of(n, 16)
    offset = tl.load(row + F_OFFSET)
    return p_ptr, g_ptr, mc_ptr, ma_ptr, vc_ptr, va_ptr, n, offset


@triton.jit
def _piece_scalars(row):
    """The piece's fp32 scalars (step size, decay, bc2_sqrt) and seed keys (k0, k1 of m, of v, of the weight)."""
    step_size = _bits_f32(tl.load(row + F_STEP))
    decay = _bits_f32(tl.load(row + F_DECAY))
    bc2_sqrt = _bits_f32(tl.load(row + F_BC2))
    km = tl.load(row + F_KM)
    ks = tl.load(row + F_KS)
    kw = tl.load(row + F_KW)
    km0, km1 = km.to(tl.int32), (km >> 32).to(tl.int32)
    ks0, ks1 = ks.to(tl.int32), (ks >> 32).to(tl.int32)
    kw0, kw1 = kw.to(tl.int32), (kw >> 32).to(tl.int32)
    return step_size, decay, bc2_sqrt, km0, km1, ks0, ks1, kw0, kw1


@triton.jit
def _tile(first, n, BLOCK_SIZE: tl.constexpr, BLOCKS: tl.constexpr):
    """The [BLOCKS, BLOCK_SIZE] tile from the piece's block `first`: its elements' mask and indices in the piece,
    its blocks' indices and mask."""
    base = first * BLOCK_SIZE                  # the tile's first element in the piece (int64)
    offs = tl.arange(0, BLOCKS)[:, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]   # [B, S] int32
    valid = offs < n - base
    ptrs = base + offs
    block = first + tl.arange(0, BLOCKS)
    bvalid = tl.arange(0, BLOCKS) * BLOCK_SIZE < n - base   # the block's first element is the piece's
    return valid, ptrs, block, bvalid


@triton.jit
def _load_codes(c_ptr, ptrs, valid, BITS: tl.constexpr):
    """The tile's level indices: a byte each (BITS 8), or half a byte (BITS 4, low half first)."""
    if BITS == 8:
        c = tl.load(c_ptr + ptrs, mask=valid, other=0).to(tl.int32)
    else:
        c = (tl.load(c_ptr + ptrs // 2, mask=valid, other=0).to(tl.int32) >> ((ptrs % 2) * 4).to(tl.int32)) & 15
    return c


@triton.jit
def _decode_moments(mc_ptr, ma_ptr, vc_ptr, va_ptr, qm_ptr, qv_ptr, ptrs, valid, block, bvalid, BITS: tl.constexpr):
    """The tile's moments: m = qmap_m[code] * absmax, s = qmap_v[code] * absmax, v = s * s."""
    am = tl.load(ma_ptr + block, mask=bvalid, other=0.0)
    av = tl.load(va_ptr + block, mask=bvalid, other=0.0)
    mc = _load_codes(mc_ptr, ptrs, valid, BITS)
    vc = _load_codes(vc_ptr, ptrs, valid, BITS)
    m = tl.load(qm_ptr + mc) * am[:, None]
    s = tl.load(qv_ptr + vc) * av[:, None]
    v = s * s
    return m, v


@triton.jit
def _load_f32(ptr, ptrs, valid, KIND: tl.constexpr):
    """The tile's weights or gradients as fp32 (bf16 from its bits), padding as 0."""
    if KIND == 1:
        bits = tl.load(ptr + ptrs, mask=valid, other=0).to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        x = bits.to(tl.float32, bitcast=True)
    else:
        x = tl.load(ptr + ptrs, mask=valid, other=0.0).to(tl.float32)
    return x


@triton.jit
def _adam_step(w, g, m, v, step_size, decay, bc2_sqrt, b1c, b2, b2c, eps, wd, WD_MODE: tl.constexpr):
    """The step (new w, m, v), the reference's operation order, one rounding per operation."""
    if WD_MODE == 2:
        w = w * decay
    elif WD_MODE == 1:
        g = g + w * _f32(wd)
    m = m + (g - m) * _f32(b1c)
    v = v * _f32(b2) + (g * g) * _f32(b2c)
    denom = tl.math.div_rn(tl.math.sqrt_rn(v), bc2_sqrt) + _f32(eps)
    w = w - step_size * tl.math.div_rn(m, denom)
    return w, m, v


@triton.jit
def _store_weight(p_ptr, ptrs, valid, w, idx, kw0, kw1, W_KIND: tl.constexpr, ROUND_WEIGHTS: tl.constexpr):
    """Store the new weights in their storage: fp32 as is; bf16 and fp16 rounded to nearest, or stochastically
    (ROUND_WEIGHTS) from the draws at indices idx of the weight's keys. Returns the weights as stored, in fp32."""
    if W_KIND == 0:
        tl.store(p_ptr + ptrs, w, mask=valid)
        stored = w
    elif W_KIND == 1:
        b = w.to(tl.uint32, bitcast=True)
        if ROUND_WEIGHTS:
            h = _bf16_bits_stochastic(b, _rng.random_words(idx, kw0, kw1))
        else:
            h = _bf16_bits_nearest(b)
        tl.store(p_ptr + ptrs, h.to(tl.uint16).to(tl.int16, bitcast=True), mask=valid)
        stored = (h << 16).to(tl.float32, bitcast=True)
    else:
        if ROUND_WEIGHTS:
            h16 = fp16_stochastic(w, _rng.uniform(idx, kw0, kw1))
        else:
            h16 = w.to(tl.float16)
        tl.store(p_ptr + ptrs, h16, mask=valid)
        stored = h16.to(tl.float32)
    return stored


@triton.jit
def _halving_sum(t, BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr, LOG2_BLOCK: tl.constexpr):
    """Per row of the [BLOCKS, BLOCK_SIZE] tile t: its sum by halving (the second half added to the first until
    one value is left), the reference's order, so the sums are its bits."""
    for i in tl.static_range(LOG2_BLOCK):
        a, b = tl.split(tl.permute(tl.reshape(t, [BLOCKS, 2, BLOCK_SIZE >> (i + 1)]), [0, 2, 1]))
        t = a + b
    return tl.reshape(t, [BLOCKS])


@triton.jit
def _score(w0, w1, valid, row, n, block, bvalid, SCORE: tl.constexpr, BLOCKS: tl.constexpr,
           BLOCK_SIZE: tl.constexpr, LOG2_BLOCK: tl.constexpr):
    """The tile's blocks' score sums (reference_adam.block_score_sums) into the piece's (3, blocks) sums, when its
    row names any (address 0: not scored)."""
    addr = tl.load(row + F_SUMS)
    sums_ptr = addr.to(tl.pointer_type(tl.float32))
    nb = (n + BLOCK_SIZE - 1) // BLOCK_SIZE
    smask = bvalid & ((block * 0 + addr) != 0)   # (a [BLOCKS] mask: the interpreter refuses a scalar one here)
    d = w1 - w0
    zero = tl.zeros_like(d)
    if SCORE == 1:
        k = tl.where(w0 != 0.0, 1.0, 0.0)
        a = tl.abs(d)
        r0 = _halving_sum(tl.where(valid, tl.math.div_rn(a * k, tl.abs(w0) + (1.0 - k)), zero), BLOCKS, BLOCK_SIZE,
                          LOG2_BLOCK)
        r1 = _halving_sum(tl.where(valid, k, zero), BLOCKS, BLOCK_SIZE, LOG2_BLOCK)
        r2 = _halving_sum(tl.where(valid, a, zero), BLOCKS, BLOCK_SIZE, LOG2_BLOCK)
    elif SCORE == 2:
        r0 = _halving_sum(tl.where(valid, d * d, zero), BLOCKS, BLOCK_SIZE, LOG2_BLOCK)
        r1 = _halving_sum(tl.where(valid, w0 * w0, zero), BLOCKS, BLOCK_SIZE, LOG2_BLOCK)
        r2 = tl.zeros([BLOCKS], tl.float32)
    else:
        r0 = _halving_sum(tl.where(valid, tl.abs(d), zero), BLOCKS, BLOCK_SIZE, LOG2_BLOCK)
        r1 = _halving_sum(tl.where(valid, 1.0, zero), BLOCKS, BLOCK_SIZE, LOG2_BLOCK)
        r2 = tl.zeros([BLOCKS], tl.float32)
    tl.store(sums_ptr + block, r0, mask=smask)
    tl.store(sums_ptr + nb + block, r1, mask=smask)
    tl.store(sums_ptr + 2 * nb + block, r2, mask=smask)


@triton.jit(do_not_specialize=["work_start"])
def _adam_blockwise_kernel(
    tab_ptr, work_start,
    qm_ptr, qv_ptr, mid_m_ptr, mid_v_ptr, gaps_m_ptr, gaps_v_ptr,
    b1c, b2, b2c, eps, wd,
    W_KIND: tl.constexpr, G_KIND: tl.constexpr, WD_MODE: tl.constexpr, ROUND_WEIGHTS: tl.constexpr,
    STOCHASTIC: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCKS: tl.constexpr, ALIGN: tl.constexpr,
    SCORE: tl.constexpr, LOG2_BLOCK: tl.constexpr, BITS: tl.constexpr,
):
    """One program: decode the moments of its tile of its work entry's piece, step, store the weights, encode the
    moments again (the module docstring)."""
    row, first = _work_entry(tab_ptr, work_start)
    p_ptr, g_ptr, mc_ptr, ma_ptr, vc_ptr, va_ptr, n, offset = _piece_pointers(row, W_KIND, G_KIND, ALIGN)
    step_size, decay, bc2_sqrt, km0, km1, ks0, ks1, kw0, kw1 = _piece_scalars(row)
    valid, ptrs, block, bvalid = _tile(first, n, BLOCK_SIZE, BLOCKS)

    m, v = _decode_moments(mc_ptr, ma_ptr, vc_ptr, va_ptr, qm_ptr, qv_ptr, ptrs, valid, block, bvalid, BITS)
    g = _load_f32(g_ptr, ptrs, valid, G_KIND)
    w0 = _load_f32(p_ptr, ptrs, valid, W_KIND)
    w, m, v = _adam_step(w0, g, m, v, step_size, decay, bc2_sqrt, b1c, b2, b2c, eps, wd, WD_MODE)

    idx = offset + ptrs            # the element's index in its parameter: its random draws
    w1 = _store_weight(p_ptr, ptrs, valid, w, idx, kw0, kw1, W_KIND, ROUND_WEIGHTS)
    if SCORE != 0:
        _score(w0, w1, valid, row, n, block, bvalid, SCORE, BLOCKS, BLOCK_SIZE, LOG2_BLOCK)

    # encode m, and s = sqrt(max(v, 0)) (NaN stays NaN)
    _encode(m, valid, idx, mc_ptr, ma_ptr, ptrs, block, bvalid, qm_ptr, mid_m_ptr, gaps_m_ptr, km0, km1, STOCHASTIC,
            BITS, BLOCKS, BLOCK_SIZE)
    s = tl.math.sqrt_rn(tl.where(v < 0.0, 0.0, v))
    _encode(s, valid, idx, vc_ptr, va_ptr, ptrs, block, bvalid, qv_ptr, mid_v_ptr, gaps_v_ptr, ks0, ks1, STOCHASTIC,
            BITS, BLOCKS, BLOCK_SIZE)


def kernel_signature() -> dict:
    """Triton signature of `_adam_blockwise_kernel` (every variant: the dtypes are constexprs) for compiling it
    without a device (bench/kernels_static.py)."""
    return {"tab_ptr": "*i64", "work_start": "i32", "qm_ptr": "*fp32", "qv_ptr": "*fp32", "mid_m_ptr": "*fp32",
            "mid_v_ptr": "*fp32", "gaps_m_ptr": "*fp32", "gaps_v_ptr": "*fp32", "b1c": "fp32", "b2": "fp32",
            "b2c": "fp32", "eps": "fp32", "wd": "fp32", "W_KIND": "constexpr", "G_KIND": "constexpr",
            "WD_MODE": "constexpr", "ROUND_WEIGHTS": "constexpr", "STOCHASTIC": "constexpr",
            "BLOCK_SIZE": "constexpr", "BLOCKS": "constexpr", "ALIGN": "constexpr", "SCORE": "constexpr",
            "LOG2_BLOCK": "constexpr", "BITS": "constexpr"}


def _f32_bits(values) -> np.ndarray:
    """The bits of the values rounded to fp32 (nearest even, beyond fp32's range +-inf: as `fp32`), as int32."""
    with np.errstate(over="ignore"):
        return np.asarray(values, dtype=np.float64).astype(np.float32).view(np.int32)


def _key_pairs(seeds) -> np.ndarray:
    """The seeds' keys (k0, k1) of `rng.seed_keys` (its hash, `rng.lowbias32`), each pair as one int64 table
    entry: k0 in the low, k1 in the high 32 bits."""
    s = torch.tensor([_as_int64(int(x) & _MASK64) for x in seeds], dtype=torch.int64)
    k0 = rng.lowbias32((s & rng.MASK32) ^ rng.SEED_SALT0)
    k1 = rng.lowbias32(((s >> 32) & rng.MASK32) ^ rng.SEED_SALT1 ^ k0)
    return (k0.numpy().astype(np.uint64) | (k1.numpy().astype(np.uint64) << np.uint64(32))).view(np.int64)


_MASK64 = (1 << 64) - 1


def _as_int64(v: int) -> int:
    """A uint64 value as the int64 with the same bits."""
    return v - (1 << 64) if v >> 63 else v


def _work(slots, programs, blocks: int) -> np.ndarray:
    """A group's work list: per program (its piece's row, the piece's first block it handles), flattened."""
    counts = np.asarray(programs, dtype=np.int64)
    piece = np.repeat(np.asarray(slots, dtype=np.int64), counts)
    start = np.repeat(np.cumsum(counts) - counts, counts)
    first = (np.arange(piece.size, dtype=np.int64) - start) * blocks
    return np.stack((piece, first), 1).reshape(-1)


def _interpreting() -> bool:
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # pragma: no cover - a triton without knobs
        import os
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y")


def _align(n: int, addresses) -> int:
    """What a launch may assume of a piece of n elements at these weight, gradient and code addresses."""
    if any(a % ALIGN_BYTES for a in addresses):
        return ALIGN_ANY
    return ALIGN_ALL if n % ALIGN_BYTES == 0 else ALIGN_PTRS


def _codec_tables(qmap_m, qmap_v, stochastic):
    """The code maps as flat tables, and the tables a launch reads besides: midpoints for the nearest codes,
    inverse gaps for the stochastic ones (the unused pair is the maps again)."""
    qm, qv = qmap_m.contiguous().view(-1), qmap_v.contiguous().view(-1)
    mid_m, mid_v = (qm, qv) if stochastic else (midpoints(qmap_m), midpoints(qmap_v))
    gaps_m, gaps_v = (inverse_gaps(qmap_m), inverse_gaps(qmap_v)) if stochastic else (qm, qv)
    return qm, qv, mid_m, mid_v, gaps_m, gaps_v


def _pieces(live, params, grads, m_codes, m_absmax, v_codes, v_absmax, block_size):
    """Per non-empty piece (`live`, the table's rows in order): its six data addresses and element count; the
    groups, (weight kind, gradient kind) -> [(row, blocks of the piece, align)]; and the gradients made contiguous
    (to keep alive until the launches are enqueued)."""
    addresses: list[int] = []
    counts: list[int] = []
    keep = []
    groups: dict[tuple, list] = {}
    for slot, j in enumerate(live):
        p, g = params[j], grads[j]
        if not (p.is_contiguous() and m_codes[j].is_contiguous() and m_absmax[j].is_contiguous()
                and v_codes[j].is_contiguous() and v_absmax[j].is_contiguous()):
            raise ValueError(f"adam_blockwise_: piece {j}'s weight, codes and block maxima must be contiguous")
        if not g.is_contiguous():
            g = g.reshape(-1).contiguous()
            keep.append(g)
        addr = (p.data_ptr(), g.data_ptr(), m_codes[j].data_ptr(), m_absmax[j].data_ptr(), v_codes[j].data_ptr(),
                v_absmax[j].data_ptr())
        n = p.numel()
        addresses += addr
        counts.append(n)
        groups.setdefault((_W_KINDS[p.dtype], _W_KINDS[g.dtype]), []).append(
            (slot, num_groups(n, block_size), _align(n, (addr[0], addr[1], addr[2], addr[4]))))
    return addresses, counts, groups, keep


def _rows(live, addresses, counts, offsets, step_sizes, decays, bc2_sqrts, seeds, score_sums) -> np.ndarray:
    """The table's rows, FIELDS entries per non-empty piece (`live`), as the module docstring lays them out."""
    rows = np.zeros((len(live), FIELDS.value), dtype=np.int64)
    rows[:, F_P.value:F_VA.value + 1] = np.asarray(addresses, dtype=np.int64).reshape(len(live), 6)
    rows[:, F_N.value] = counts
    rows[:, F_OFFSET.value] = [int(offsets[j]) for j in live]
    rows[:, F_STEP.value] = _f32_bits([step_sizes[j] for j in live])
    rows[:, F_DECAY.value] = _f32_bits([decays[j] for j in live])
    rows[:, F_BC2.value] = _f32_bits([bc2_sqrts[j] for j in live])
    rows[:, F_KM.value:F_KW.value + 1] = _key_pairs([seeds[3 * j + k] for j in live for k in range(3)]).reshape(-1, 3)
    if len(score_sums):
        rows[:, F_SUMS.value] = [score_sums[j].data_ptr() if score_sums[j].numel() else 0 for j in live]
    return rows


def _group_launches(groups, block_size: int, start: int):
    """Per group, its work list (in the table from entry `start` on, one after another) and its launch: (weight
    kind, gradient kind, BLOCKS of its largest piece, the least ALIGN of its pieces, work_start, programs)."""
    parts, launches = [], []
    for (w_kind, g_kind), pieces in groups.items():
        blocks = blocks_per_program(block_size, max(nb for _, nb, _ in pieces))
        programs = [-(-nb // blocks) for _, nb, _ in pieces]
        parts.append(_work([slot for slot, _, _ in pieces], programs, blocks))
        launches.append((w_kind, g_kind, blocks, min(a for _, _, a in pieces), start, sum(programs)))
        start += 2 * sum(programs)
    return parts, launches


def _table(rows: np.ndarray, parts, device: torch.device) -> torch.Tensor:
    """The call's table (the rows, then the groups' work lists) on the pieces' device."""
    table = torch.from_numpy(np.concatenate([rows.reshape(-1), *parts]))
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)   # one copy, no wait
    return table


def _launch_group(table, launch, tables, scalars, wd_mode: int, round_weights, stochastic, block_size: int,
                  score: int, bits: int) -> None:
    """One launch of the kernel over a group's work list (`launch` as `_group_launches` makes it)."""
    w_kind, g_kind, blocks, align, work_start, n_programs = launch
    _adam_blockwise_kernel[(n_programs,)](
        table, work_start, *tables, *scalars,
        W_KIND=w_kind, G_KIND=g_kind, WD_MODE=wd_mode,
        ROUND_WEIGHTS=bool(round_weights) and w_kind != W_FP32, STOCHASTIC=bool(stochastic),
        BLOCK_SIZE=block_size, BLOCKS=blocks, ALIGN=align, SCORE=score, LOG2_BLOCK=block_size.bit_length() - 1,
        BITS=bits,
        num_warps=num_warps(blocks * block_size, align, bool(score) or bits == 4), enable_fp_fusion=False,
    )


def adam_blockwise_(params, grads, m_codes, m_absmax, v_codes, v_absmax, qmap_m, qmap_v, step_sizes, decays,
                    bc2_sqrts, beta1, beta2, eps, weight_decay, decoupled, block_size, stochastic, seeds, offsets,
                    round_weights, score_sums=(), score=0) -> None:
    """The reference's op (reference_adam.adam_blockwise_), in place: one launch per (weight dtype, gradient
    dtype) among the non-empty pieces. Every piece's tensors contiguous (the op's checks, validation.py)."""
    live = [j for j, p in enumerate(params) if p.numel() > 0]
    if not live:
        return
    device = params[live[0]].device
    if device.type != "cpu" and _interpreting():
        # the interpreter reads the table's addresses on the host: step CPU copies, then write them back
        lists = [[t.cpu() for t in ts] for ts in (params, grads, m_codes, m_absmax, v_codes, v_absmax, score_sums)]
        adam_blockwise_(*lists[:6], qmap_m.cpu(), qmap_v.cpu(), step_sizes, decays, bc2_sqrts, beta1, beta2, eps,
                        weight_decay, decoupled, block_size, stochastic, seeds, offsets, round_weights, lists[6], score)
        for dst, src in zip((params, m_codes, m_absmax, v_codes, v_absmax, score_sums), (lists[0], *lists[2:])):
            for j in live if len(dst) else ():
                if dst[j].numel():
                    dst[j].copy_(src[j])
        return

    b1c, b2, b2c = fp32(1.0 - beta1), fp32(beta2), fp32(1.0 - beta2)
    eps, wd = fp32(eps), fp32(weight_decay)
    wd_mode = WD_NONE if wd == 0.0 else (WD_DECOUPLED if decoupled else WD_L2)
    tables = _codec_tables(qmap_m, qmap_v, stochastic)
    addresses, counts, groups, keep = _pieces(live, params, grads, m_codes, m_absmax, v_codes, v_absmax, block_size)
    rows = _rows(live, addresses, counts, offsets, step_sizes, decays, bc2_sqrts, seeds,
                 score_sums if score else ())
    parts, launches = _group_launches(groups, block_size, rows.size)
    table = _table(rows, parts, device)
    with on_device(table):
        for launch in launches:
            _launch_group(table, launch, tables, (b1c, b2, b2c, eps, wd), wd_mode, round_weights, stochastic,
                          block_size, score, blockwise_bits(qmap_m))
    del keep   # (the launches are enqueued: the caching allocator orders any reuse after them)
