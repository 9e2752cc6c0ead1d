"""Per-group asymmetric min/max quantization (2/4/8-bit) and its inverse, in Triton.

One program handles GROUPS consecutive groups (BLOCK = GROUPS * GROUP_SIZE, about BLOCK_ELEMS
elements), seen as a [GROUPS, GROUP_SIZE] tile: element (g, j) of program `pid` is flat index
    base + g * GROUP_SIZE + j,   base = pid * BLOCK
and the PER = 8 // bits codes of a byte are packed/unpacked as a [BLOCK // PER, PER] tile
(a reduction over the last axis). A launch is cdiv(num_groups, GROUPS) programs.

Shaped for bandwidth (bench/kernels_static.py reads the sm_90a SASS):
  * offsets inside a program are int32; only the program's base is int64, and only when the
    tensor has 2**31 elements or more (IDX64, chosen by the launcher);
  * one IEEE reciprocal per group (`div_rn(1, divisor)`) and a multiply per element: the
    formula of the reference, which is written the same way;
  * EVEN (numel a multiple of BLOCK, chosen by the launcher) drops every mask: unmasked
    16-byte loads and stores, no identity selects before the min/max;
  * min/max propagate NaN in the reduction itself (`tl.minimum(..., propagate_nan=ALL)`, one
    FMNMX.NAN per element on sm_80+) instead of a separate NaN count;
  * stochastic rounding: the high half of the element index is folded into the seed key once
    per program (blocks are aligned to BLOCK, a power of two, so they never straddle 2**32),
    the hash then runs on the 32-bit low half only;
  * clamp then truncate instead of floor then clamp (equal for every input, NaN -> 0).

Bit-exactness with `reference.quantize` / `reference.dequantize`:
  * all math in fp32, same operation order; IEEE division (`tl.math.div_rn`) for the scale and
    the reciprocal (Triton's `/` on fp32 is the approximate division on NVIDIA GPUs);
  * every step rounded on its own: kernels are launched with `enable_fp_fusion=False`, so
    (x - mn) * inv + 0.5 and code * scale + offset are never contracted into an FMA;
  * stochastic rounding uses the counter-based hash of `rng` at the flat element index.
"""

import dataclasses
import math

import torch
import triton
import triton.language as tl

from ..validation import num_groups, op_dequantize, op_quantize, packed_code_bytes
from . import _rng
from ._common import on_device

# ~4096 elements per program (16 KiB of fp32 in, 0.5-4 KiB of codes out), i.e. 128 groups
# of 32 or 16 groups of 256: many groups per program, 8192 programs at 32M elements.
BLOCK_ELEMS = 4096
NUM_WARPS = 8  # 16 elements per thread: <= 64 registers on sm_90, vectorised 16-byte loads


def _groups_per_program(group_size: int, ng: int) -> int:
    g = max(1, BLOCK_ELEMS // group_size)
    # Small tensors: do not launch a block far larger than the data.
    return min(g, triton.next_power_of_2(max(ng, 1)))


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Block shape of both kernels for a tensor of `ng` groups (shared with bench/kernels_static.py)."""
    groups: int
    group_size: int
    num_warps: int

    @property
    def elements(self) -> int:
        return self.groups * self.group_size

    def constexprs(self, bits: int, group_size: int, stochastic: bool, even: bool = True, idx64: bool = False) -> dict:
        return {"BITS": bits, "GROUP_SIZE": group_size, "GROUPS": self.groups, "STOCHASTIC": bool(stochastic),
                "EVEN": bool(even), "IDX64": bool(idx64)}

    def dequant_constexprs(self, bits: int, group_size: int) -> dict:
        return {"BITS": bits, "GROUP_SIZE": group_size, "GROUPS": self.groups}


def extra_constexprs(n: int, block: int) -> dict:
    """EVEN: every program full (no masks); IDX64: int64 program bases (a tensor of 2**31
    elements or more; the last program's offsets must stay below 2**31 too)."""
    return {"EVEN": n % block == 0, "IDX64": n + block >= 2**31}


def launch_config(group_size: int, ng: int, stochastic: bool = False) -> LaunchConfig:
    # The hash needs registers: stochastic rounding runs 8 elements per thread (16 warps) so that
    # every variant stays within 64 registers on sm_90 (bench/kernels_static.py).
    return LaunchConfig(_groups_per_program(group_size, ng), group_size, 2 * NUM_WARPS if stochastic else NUM_WARPS)


def kernel_signature(x_type: str, stochastic: bool = False) -> dict:
    """Triton signature of `_quantize_kernel` for an input of pointer type x_type ('*fp32', ...)."""
    return {"x_ptr": x_type, "codes_ptr": "*u8", "scale_ptr": "*fp32", "offset_ptr": "*fp32",
            "n_elements": "i32", "n_groups": "i32", "n_bytes": "i32", "k0": "i32", "k1": "i32",
            "BITS": "constexpr", "GROUP_SIZE": "constexpr", "GROUPS": "constexpr", "STOCHASTIC": "constexpr",
            "EVEN": "constexpr", "IDX64": "constexpr"}


def dequantize_signature(out_type: str) -> dict:
    return {"codes_ptr": "*u8", "scale_ptr": "*fp32", "offset_ptr": "*fp32", "out_ptr": out_type,
            "n_elements": "i32", "n_groups": "i32", "n_bytes": "i32",
            "BITS": "constexpr", "GROUP_SIZE": "constexpr", "GROUPS": "constexpr"}


FP32_MAX = tl.constexpr(3.4028234663852886e38)  # the largest finite fp32 (a constexpr global: kernels may read it)


@triton.jit
def _nan_min(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _scale_and_codes(x, mn, mx, base, offs, k0, k1,
                     BITS: tl.constexpr, STOCHASTIC: tl.constexpr, IDX64: tl.constexpr):
    """(scale [G], codes [G, S] int32) of a [G, S] tile with group minima mn and maxima mx."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    levels = tl.full((), LEVELS, tl.float32)
    # A wide group (finite, but mx - mn overflows fp32: +-3e38) runs at half scale, exactly; for
    # every other group h = 1 and these are (mx - mn) / L and (x - mn) * inv (reference.py).
    wide = (mx - mn > FP32_MAX) & (mx <= FP32_MAX) & (mn >= -FP32_MAX)
    h = tl.where(wide, 0.5, 1.0)
    scaled = tl.math.div_rn(mx * h - mn * h, levels)
    scale = tl.where(wide, scaled * 2.0, scaled)
    divisor = tl.where(scaled >= 1.1754943508222875e-38, scaled, 1.0)  # 2**-126; NaN -> 1
    inv = tl.math.div_rn(tl.full((), 1.0, tl.float32), divisor)
    q = (x * h[:, None] - (mn * h)[:, None]) * inv[:, None]
    if STOCHASTIC:
        lo = (base + offs).to(tl.uint32)                                # low 32 bits of the index
        hk1 = ((base >> 32).to(tl.uint32) if IDX64 else tl.full((), 0, tl.uint32)) ^ k1.to(tl.uint32, bitcast=True)
        q = q + _rng.uniform_hoisted(lo, hk1, k0)
    else:
        q = q + 0.5
    # clamp(floor(t), 0, L) == trunc(clamp(t, 0, L)): truncation is floor for t >= 0 (NaN -> 0)
    return scale, tl.minimum(tl.maximum(q, 0.0), levels).to(tl.int32)


@triton.jit
def _store_packed_codes(codes_ptr, c, pid, offs, n_bytes,
                        BITS: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """The [G, S] codes `c` of program `pid`, PER = 8 // BITS to a byte."""
    PER: tl.constexpr = 8 // BITS
    bytes_base = pid * (BLOCK // PER)
    if PER == 1:
        b_offs = offs
        packed = c
    else:
        # PER consecutive codes per byte, little-endian (disjoint bits: sum == or).
        c = tl.reshape(c, [BLOCK // PER, PER])
        packed = tl.sum(c << (tl.arange(0, PER) * BITS)[None, :], axis=1)
        b_offs = tl.arange(0, BLOCK // PER)
    if EVEN:
        tl.store(codes_ptr + bytes_base + b_offs, packed.to(tl.uint8))
    else:
        tl.store(codes_ptr + bytes_base + b_offs, packed.to(tl.uint8), mask=b_offs < n_bytes - bytes_base)


@triton.jit
def _store_group_params(scale_ptr, offset_ptr, scale, mn, pid, n_groups, GROUPS: tl.constexpr, EVEN: tl.constexpr):
    """Each group's scale and offset (its minimum)."""
    group = pid * GROUPS + tl.arange(0, GROUPS)
    if EVEN:
        tl.store(scale_ptr + group, scale)
        tl.store(offset_ptr + group, mn)
    else:
        gmask = group < n_groups
        tl.store(scale_ptr + group, scale, mask=gmask)
        tl.store(offset_ptr + group, mn, mask=gmask)


@triton.jit(do_not_specialize=["k0", "k1"])
def _quantize_kernel(
    x_ptr, codes_ptr, scale_ptr, offset_ptr,
    n_elements, n_groups, n_bytes,
    k0, k1,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUPS: tl.constexpr, STOCHASTIC: tl.constexpr,
    EVEN: tl.constexpr = False, IDX64: tl.constexpr = True,
):
    BLOCK: tl.constexpr = GROUPS * GROUP_SIZE

    pid = tl.program_id(0)
    if IDX64:
        pid = pid.to(tl.int64)
    base = pid * BLOCK
    offs = tl.arange(0, GROUPS)[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]   # [G, S] int32
    if EVEN:
        x = tl.load(x_ptr + base + offs).to(tl.float32)
        mn = tl.reduce(x, 1, _nan_min)
        mx = tl.reduce(x, 1, _nan_max)
    else:
        valid = offs < n_elements - base
        x = tl.load(x_ptr + base + offs, mask=valid, other=0.0).to(tl.float32)
        mn = tl.reduce(tl.where(valid, x, float("inf")), 1, _nan_min)                      # [G]
        mx = tl.reduce(tl.where(valid, x, float("-inf")), 1, _nan_max)

    scale, c = _scale_and_codes(x, mn, mx, base, offs, k0, k1, BITS, STOCHASTIC, IDX64)
    if not EVEN:
        c = tl.where(valid, c, 0)                                       # unused high bits stay 0
    _store_packed_codes(codes_ptr, c, pid, offs, n_bytes, BITS, BLOCK, EVEN)
    _store_group_params(scale_ptr, offset_ptr, scale, mn, pid, n_groups, GROUPS, EVEN)


def quantize(x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int):
    op_quantize(x, bits, group_size, stochastic, seed)  # the op's contract: any int64 seed, read as unsigned
    n = x.numel()
    ng = num_groups(n, group_size)
    nbytes = packed_code_bytes(n, bits)
    codes = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    scale = torch.empty(ng, dtype=torch.float32, device=x.device)
    offset = torch.empty(ng, dtype=torch.float32, device=x.device)
    if n == 0:
        return codes, scale, offset
    x = x.contiguous().view(-1)
    cfg = launch_config(group_size, ng, stochastic)
    k0, k1 = _rng.seed_key_args(seed)
    grid = (triton.cdiv(ng, cfg.groups),)
    with on_device(x):
        _quantize_kernel[grid](
            x, codes, scale, offset,
            n, ng, nbytes,
            k0, k1,
            BITS=bits, GROUP_SIZE=group_size, GROUPS=cfg.groups, STOCHASTIC=bool(stochastic),
            **extra_constexprs(n, cfg.elements),
            num_warps=cfg.num_warps, enable_fp_fusion=False,
        )
    return codes, scale, offset


@triton.jit
def _dequantize_kernel(
    codes_ptr, scale_ptr, offset_ptr, out_ptr,
    n_elements, n_groups, n_bytes,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUPS: tl.constexpr,
):
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    BLOCK: tl.constexpr = GROUPS * GROUP_SIZE

    pid = tl.program_id(0).to(tl.int64)
    byte = pid * (BLOCK // PER) + tl.arange(0, BLOCK // PER)
    packed = tl.load(codes_ptr + byte, mask=byte < n_bytes, other=0).to(tl.int32)
    code = (packed[:, None] >> (tl.arange(0, PER) * BITS)[None, :]) & MASK      # [B, PER]
    code = tl.reshape(code, [GROUPS, GROUP_SIZE]).to(tl.float32)

    group = pid * GROUPS + tl.arange(0, GROUPS)
    gmask = group < n_groups
    scale = tl.load(scale_ptr + group, mask=gmask, other=0.0)
    offset = tl.load(offset_ptr + group, mask=gmask, other=0.0)
    # Two roundings (the launch disables fp fusion): exactly the reference's fp32 math.
    y = code * scale[:, None]
    y = y + offset[:, None]
    # Overflow with a finite scale and offset (a wide group's upper codes): the same value a
    # quarter down, saturated at the largest fp32 (reference.py).
    finite = (tl.abs(scale) <= FP32_MAX) & (tl.abs(offset) <= FP32_MAX)
    quarter = (code * (scale * 0.25)[:, None] + (offset * 0.25)[:, None]) * 4.0
    quarter = tl.minimum(tl.maximum(quarter, -FP32_MAX), FP32_MAX)
    y = tl.where((tl.abs(y) > FP32_MAX) & finite[:, None], quarter, y)
    idx = group[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    tl.store(out_ptr + idx, y.to(out_ptr.dtype.element_ty), mask=idx < n_elements)


_KERNEL_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dequantize(codes, scale, offset, bits: int, group_size: int, shape, dtype):
    op_dequantize(codes, scale, offset, bits, group_size, shape, dtype)  # the sizes, before any allocation
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=codes.device)
    ng = num_groups(n, group_size)
    nbytes = packed_code_bytes(n, bits)
    codes = codes.contiguous().view(-1)
    scale = scale.to(torch.float32).contiguous().view(-1)
    offset = offset.to(torch.float32).contiguous().view(-1)
    kernel_dtype = dtype if dtype in _KERNEL_OUT_DTYPES else torch.float32
    out = torch.empty(shape, dtype=kernel_dtype, device=codes.device)
    groups = _groups_per_program(group_size, ng)
    grid = (triton.cdiv(ng, groups),)
    with on_device(out):
        _dequantize_kernel[grid](
            codes, scale, offset, out,
            n, ng, nbytes,
            BITS=bits, GROUP_SIZE=group_size, GROUPS=groups,
            num_warps=NUM_WARPS, enable_fp_fusion=False,
        )
    # Other dtypes (float64, ...): one exact fp32 -> dtype cast, as the reference does.
    return out if kernel_dtype == dtype else out.to(dtype)
