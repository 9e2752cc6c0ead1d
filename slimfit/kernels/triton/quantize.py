"""Per-group asymmetric min/max quantization (2/4/8-bit) and its inverse, in Triton.

Both kernels see the flattened tensor as a 3-D block per program:
    [GROUPS, GROUP_SIZE // PER, PER]      PER = 8 // bits codes per byte
so element (g, b, j) of program `pid` is flat index
    (pid * GROUPS + g) * GROUP_SIZE + b * PER + j
and the PER codes of byte (g, b) are packed/unpacked with a reduction over the last
axis (no reshape, no shuffles). One program handles GROUPS consecutive groups, about
BLOCK_ELEMS elements, so a launch is cdiv(num_groups, GROUPS) programs.

Bit-exactness with `reference.quantize` / `reference.dequantize`:
  * all math in fp32, same operation order;
  * IEEE division (`tl.math.div_rn`) for scale and q: Triton's `/` on fp32 is the
    approximate division on NVIDIA GPUs;
  * dequantize computes code * scale, then + offset, as two roundings: kernels are
    launched with `enable_fp_fusion=False` so the backend never contracts them into an FMA;
  * stochastic rounding uses the counter-based hash of `rng` at the flat element index.
NaN contract: tl.min / tl.max need not propagate NaN, so a group holding NaN is detected
explicitly and gets scale = offset = NaN (as in the reference); Inf propagates by itself.
"""

import dataclasses
import math

import torch
import triton
import triton.language as tl

from ..validation import check_float_input, check_quant_args, check_seed, num_groups, packed_code_bytes
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

    def constexprs(self, bits: int, group_size: int, stochastic: bool) -> dict:
        return {"BITS": bits, "GROUP_SIZE": group_size, "GROUPS": self.groups, "STOCHASTIC": bool(stochastic)}

    def dequant_constexprs(self, bits: int, group_size: int) -> dict:
        return {"BITS": bits, "GROUP_SIZE": group_size, "GROUPS": self.groups}


def launch_config(group_size: int, ng: int) -> LaunchConfig:
    return LaunchConfig(_groups_per_program(group_size, ng), group_size, NUM_WARPS)


def kernel_signature(x_type: str, stochastic: bool = False) -> dict:
    """Triton signature of `_quantize_kernel` for an input of pointer type x_type ('*fp32', ...)."""
    return {"x_ptr": x_type, "codes_ptr": "*u8", "scale_ptr": "*fp32", "offset_ptr": "*fp32",
            "n_elements": "i32", "n_groups": "i32", "n_bytes": "i32", "k0": "i32", "k1": "i32",
            "BITS": "constexpr", "GROUP_SIZE": "constexpr", "GROUPS": "constexpr", "STOCHASTIC": "constexpr"}


def dequantize_signature(out_type: str) -> dict:
    return {"codes_ptr": "*u8", "scale_ptr": "*fp32", "offset_ptr": "*fp32", "out_ptr": out_type,
            "n_elements": "i32", "n_groups": "i32", "n_bytes": "i32",
            "BITS": "constexpr", "GROUP_SIZE": "constexpr", "GROUPS": "constexpr"}


@triton.jit(do_not_specialize=["k0", "k1"])
def _quantize_kernel(
    x_ptr, codes_ptr, scale_ptr, offset_ptr,
    n_elements, n_groups, n_bytes,
    k0, k1,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUPS: tl.constexpr, STOCHASTIC: tl.constexpr,
):
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    BLOCK: tl.constexpr = GROUPS * GROUP_SIZE

    pid = tl.program_id(0).to(tl.int64)
    group = pid * GROUPS + tl.arange(0, GROUPS)                                  # [G] int64
    idx = group[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]       # [G, S] int64
    valid = idx < n_elements

    x = tl.load(x_ptr + idx, mask=valid, other=0.0).to(tl.float32)
    mn = tl.min(tl.where(valid, x, float("inf")), axis=1)                       # [G]
    mx = tl.max(tl.where(valid, x, float("-inf")), axis=1)
    # NaN is not guaranteed to win a tl.min / tl.max: detect it and poison the group.
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    mn = tl.where(has_nan, float("nan"), mn)
    mx = tl.where(has_nan, float("nan"), mx)

    levels = tl.full((), LEVELS, tl.float32)
    scale = tl.math.div_rn(mx - mn, levels)
    divisor = tl.where(scale > 0, scale, 1.0)
    q = tl.math.div_rn(x - mn[:, None], divisor[:, None])
    if STOCHASTIC:
        q = q + _rng.uniform(idx, k0, k1)
    else:
        q = q + 0.5
    c = tl.minimum(tl.maximum(tl.floor(q), 0.0), levels)
    c = tl.where(valid, c.to(tl.int32), 0)                     # unused high bits stay 0

    # Pack PER consecutive codes per byte, little-endian (disjoint bits: sum == or).
    c = tl.reshape(c, [BLOCK // PER, PER])
    packed = tl.sum(c << (tl.arange(0, PER) * BITS)[None, :], axis=1)
    byte = pid * (BLOCK // PER) + tl.arange(0, BLOCK // PER)
    tl.store(codes_ptr + byte, packed.to(tl.uint8), mask=byte < n_bytes)

    gmask = group < n_groups
    tl.store(scale_ptr + group, scale, mask=gmask)
    tl.store(offset_ptr + group, mn, mask=gmask)


def quantize(x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int):
    check_float_input(x, "quantize")
    check_quant_args(bits, group_size)
    check_seed(seed, "quantize")
    n = x.numel()
    ng = num_groups(n, group_size)
    nbytes = packed_code_bytes(n, bits)
    codes = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    scale = torch.empty(ng, dtype=torch.float32, device=x.device)
    offset = torch.empty(ng, dtype=torch.float32, device=x.device)
    if n == 0:
        return codes, scale, offset
    x = x.contiguous().view(-1)
    groups = _groups_per_program(group_size, ng)
    k0, k1 = _rng.seed_key_args(seed)
    grid = (triton.cdiv(ng, groups),)
    with on_device(x):
        _quantize_kernel[grid](
            x, codes, scale, offset,
            n, ng, nbytes,
            k0, k1,
            BITS=bits, GROUP_SIZE=group_size, GROUPS=groups, STOCHASTIC=bool(stochastic),
            num_warps=NUM_WARPS, enable_fp_fusion=False,
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
    idx = group[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    tl.store(out_ptr + idx, y.to(out_ptr.dtype.element_ty), mask=idx < n_elements)


_KERNEL_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dequantize(codes, scale, offset, bits: int, group_size: int, shape, dtype):
    check_quant_args(bits, group_size)
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=codes.device)
    ng = num_groups(n, group_size)
    nbytes = packed_code_bytes(n, bits)
    if not (codes.device == scale.device == offset.device):
        raise ValueError(
            f"slimfit.dequantize: codes, scale and offset must be on one device, got "
            f"{codes.device}, {scale.device}, {offset.device}"
        )
    if codes.dtype != torch.uint8:
        raise TypeError(f"slimfit.dequantize: codes must be uint8, got {codes.dtype}")
    if codes.numel() < nbytes:
        raise ValueError(
            f"slimfit.dequantize: {codes.numel()} code bytes cannot hold {n} {bits}-bit codes "
            f"(need {nbytes}); shape/bits do not match the quantized tensor"
        )
    if scale.numel() < ng or offset.numel() < ng:
        raise ValueError(
            f"slimfit.dequantize: need {ng} scales and offsets for {n} elements in groups of "
            f"{group_size}, got {scale.numel()} and {offset.numel()}"
        )
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
