"""User-facing compression primitives: argument checks, NaN/Inf errors, and small
named structures of tensors plus static metadata (what autograd functions save)."""
from __future__ import annotations

import math
import numbers
import operator
from typing import NamedTuple

import torch

from . import _ops  # noqa: F401  (registers torch.ops.slimfit.*)
from .validation import (
    BLOCKWISE_BLOCK_SIZES,
    QMAP_LEVELS,
    _is_int,
    blockwise_bits,
    check_dropout_p,
    check_flag,
    check_float_input,
    check_quant_args,
    check_seed,
    check_shape,
    check_tensor,
    check_topk_args,
)

ops = torch.ops.slimfit


class QuantizedTensor(NamedTuple):
    codes: torch.Tensor   # uint8, bit-packed codes of the flattened tensor
    scale: torch.Tensor   # fp32, one per group
    offset: torch.Tensor  # fp32 (group minimum), one per group
    shape: tuple
    dtype: torch.dtype
    bits: int
    group_size: int
    # None: codes follow the tensor's logical (row-major) order. Else quantize(storage_order=True)
    # took a permuted view x = base.permute(...) as it lies in memory: base = x.permute(storage_dims)
    # was flattened, and dequantize permutes back (a view, no copy).
    storage_dims: tuple | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scale, self.offset

    def meta(self) -> tuple:
        return self.shape, self.dtype, self.bits, self.group_size, self.storage_dims

    @classmethod
    def from_parts(cls, tensors, meta) -> "QuantizedTensor":
        return cls(*tensors, *meta)

    def elements(self, start: int, end: int) -> "QuantizedTensor":
        """Flat elements [start, end) of a tensor quantized in logical order, as a 1-d QuantizedTensor that
        shares this one's codes, scales and offsets (views, nothing copied): dequantized, each element is what
        the whole tensor's dequantize gives there. `start` must begin a group (group_size divides it)."""
        n = math.prod(self.shape)
        if self.storage_dims is not None or start % self.group_size or not 0 <= start < end <= n:
            raise ValueError(f"QuantizedTensor.elements({start}, {end}): needs logical order (storage_dims None), "
                             f"0 <= start < end <= {n} and start a multiple of group_size {self.group_size}")
        per_byte = 8 // self.bits
        codes = self.codes.reshape(-1)[start // per_byte:-(-end // per_byte)]
        groups = slice(start // self.group_size, -(-end // self.group_size))
        return QuantizedTensor(codes, self.scale.reshape(-1)[groups], self.offset.reshape(-1)[groups], (end - start,),
                               self.dtype, self.bits, self.group_size)


class BlockwiseTensor(NamedTuple):
    """A tensor block-wise dynamically quantized (quantize_blockwise): codes of a map, one absmax per block."""
    codes: torch.Tensor   # uint8, codes of the flattened tensor (4-bit: two per byte, little-endian)
    absmax: torch.Tensor  # fp32, the largest magnitude of each block
    qmap: torch.Tensor    # fp32, the map's 16 or 256 sorted levels (slimfit.kernels.qmaps; shared, not owned)
    shape: tuple
    dtype: torch.dtype
    block_size: int

    @property
    def bits(self) -> int:
        return blockwise_bits(self.qmap)

    @property
    def nbytes(self) -> int:
        """Codes and block maxima; the map is shared by every tensor coded with it and not counted."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.absmax))


class PrunedTensor(NamedTuple):
    values: torch.Tensor   # (*leading, k), input dtype
    indices: torch.Tensor  # (*leading, k), int16 or int32, ascending per row
    row_length: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.indices))


def new_seed() -> int:
    """A seed drawn from torch's default CPU generator, so torch.manual_seed makes runs repeatable."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())


def _raise_non_finite(op: str, what: str) -> None:
    raise ValueError(
        f"slimfit.{op}: the input contains NaN or Inf ({what}); compressing it would give silent "
        "garbage. Check the model for overflow (e.g. fp16 without loss scaling) or pass "
        "check_finite=False to skip this check."
    )


def _check_quantized_finite(scale: torch.Tensor, offset: torch.Tensor) -> None:
    """Raises when a group's scale or offset is not finite: only a NaN/Inf input gives one (a finite
    group whose range max - min exceeds fp32, e.g. +-3e38, is quantized at half scale: finite scale).
    One host read."""
    if not scale.numel() or bool(torch.isfinite(scale).all() & torch.isfinite(offset).all()):
        return
    _raise_non_finite("quantize", "an input entry is not finite")


def quantize(
    x: torch.Tensor,
    bits: int = 8,
    group_size: int = 128,
    stochastic: bool = False,
    seed: int | None = None,
    check_finite: bool = False,
    storage_order: bool = False,
) -> QuantizedTensor:
    """Per-group asymmetric min/max quantization of x (flattened) to `bits` bits.

    check_finite=True raises on a NaN/Inf input, at the cost of one host synchronisation on a GPU
    (it reads the per-group scales). Off (the default), a non-finite group gets a non-finite scale
    or offset, so it dequantizes to non-finite values. Finite input always gives a finite scale,
    even when a group's range exceeds fp32 (+-3e38), and dequantizes to finite values.

    storage_order=True: when x is a permuted view of a dense tensor (attention's Q/K/V as
    ``(B, S, H, D).transpose(1, 2)``), the groups follow memory order and nothing is copied;
    otherwise x is flattened in its logical order, which needs a contiguous copy of such a view.
    `dequantize` returns the same logical shape either way."""
    check_float_input(x, "quantize")
    check_quant_args(bits, group_size)
    bits, group_size = operator.index(bits), operator.index(group_size)  # numpy / 0-d tensor ints: plain ints
    stochastic = check_flag(stochastic, "stochastic", "quantize")
    if seed is None:
        seed = new_seed() if stochastic else 0
    check_seed(seed, "quantize")
    dims = storage_permutation(x) if check_flag(storage_order, "storage_order", "quantize") else None
    stored = x if dims is None else x.permute(dims)
    codes, scale, offset = ops.quantize(stored, bits, group_size, stochastic, operator.index(seed))
    if check_finite:
        _check_quantized_finite(scale, offset)
    return QuantizedTensor(codes, scale, offset, tuple(x.shape), x.dtype, bits, group_size, dims)


def quantize_blockwise(x: torch.Tensor, qmap: torch.Tensor, block_size: int = 256, check_finite: bool = False,
                       stochastic: bool = False, seed: int | None = None) -> BlockwiseTensor:
    """Block-wise dynamic quantization of x (flattened): per block of ``block_size`` elements, each value
    divided by the block's largest magnitude becomes the index of a level of ``qmap`` (a sorted fp32 map of 16
    or 256 levels: 4- or 8-bit codes; slimfit.kernels.qmaps has the moment maps): the nearest one, or with
    ``stochastic=True`` one of the two around it, the upper with probability the value's place between them
    (unbiased: a value re-encoded at every step can drift by less than a level), drawn from ``seed`` (a new
    one from torch's generator when None) as ``quantize`` draws its. The exact formulas are in
    slimfit/kernels/reference.py.

    check_finite=True raises on a NaN/Inf input, at the cost of one host read of the block maxima; off (the
    default), a block holding one gets a non-finite absmax and dequantizes to non-finite values."""
    check_float_input(x, "quantize_blockwise")
    check_tensor(qmap, "qmap", "quantize_blockwise")
    if qmap.dtype != torch.float32 or qmap.dim() != 1 or qmap.numel() not in QMAP_LEVELS:
        raise ValueError(f"slimfit.quantize_blockwise: qmap must be a 1-D float32 tensor of 16 or 256 sorted "
                         f"levels (slimfit.kernels.qmaps.signed(8), ...), got {qmap.dtype} of shape "
                         f"{list(qmap.shape)}")
    if not _is_int(block_size) or operator.index(block_size) not in BLOCKWISE_BLOCK_SIZES:
        raise ValueError(f"slimfit.quantize_blockwise: block_size must be one of {BLOCKWISE_BLOCK_SIZES}, got "
                         f"{block_size!r}")
    block_size = operator.index(block_size)
    stochastic = check_flag(stochastic, "stochastic", "quantize_blockwise")
    if seed is None:
        seed = new_seed() if stochastic else 0
    check_seed(seed, "quantize_blockwise")
    codes, absmax = ops.quantize_blockwise(x, qmap, block_size, stochastic, operator.index(seed))
    if check_finite and absmax.numel() and not bool(torch.isfinite(absmax).all()):
        _raise_non_finite("quantize_blockwise", "an input entry is not finite")
    return BlockwiseTensor(codes, absmax, qmap, tuple(x.shape), x.dtype, block_size)


def dequantize_blockwise(q: BlockwiseTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor quantize_blockwise coded: qmap[code] * absmax of its block, in ``dtype`` (default: the
    original dtype)."""
    if not isinstance(q, BlockwiseTensor):
        raise TypeError(f"slimfit.dequantize_blockwise: expected the BlockwiseTensor quantize_blockwise returned, "
                        f"got {type(q).__name__}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"slimfit.dequantize_blockwise: dtype must be a torch.dtype (e.g. torch.float32), got "
                        f"{dtype!r}")
    return ops.dequantize_blockwise(q.codes, q.absmax, q.qmap, q.block_size, list(q.shape), dtype or q.dtype)


def storage_permutation(x: torch.Tensor) -> tuple | None:
    """dims such that ``x.permute(dims)`` is contiguous (x's dimensions in memory order), or None
    when x is contiguous already or is not a permuted dense tensor (a slice, an expanded view)."""
    if x.is_contiguous():
        return None
    dims = tuple(sorted(range(x.dim()), key=lambda d: (-x.stride(d), d)))
    expected = 1  # the strides of a dense tensor in that order (read from sizes and strides: no op dispatched)
    for d in reversed(dims):
        if x.size(d) != 1 and x.stride(d) != expected:
            return None
        expected *= x.size(d)
    return dims


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"slimfit.dequantize: expected the QuantizedTensor quantize returned, got {type(q).__name__}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"slimfit.dequantize: dtype must be a torch.dtype (e.g. torch.float32), got {dtype!r}")
    if q.storage_dims is None:
        return ops.dequantize(q.codes, q.scale, q.offset, q.bits, q.group_size, list(q.shape), dtype or q.dtype)
    dims = q.storage_dims
    stored = ops.dequantize(q.codes, q.scale, q.offset, q.bits, q.group_size, [q.shape[d] for d in dims],
                            dtype or q.dtype)
    return stored.permute([dims.index(d) for d in range(len(dims))])


def topk_prune(
    x: torch.Tensor,
    k: int | None = None,
    ratio: float | None = None,
    by_magnitude: bool = True,
    check_finite: bool = False,
) -> PrunedTensor:
    """Keep the k largest entries of each row (last dimension); give k or ratio (0, 1].

    check_finite=True raises on a NaN/Inf input (one host synchronisation on a GPU); off (the
    default), NaN ranks above every number and is kept, so it reaches the restored tensor."""
    check_float_input(x, "topk_prune")
    by_magnitude = check_flag(by_magnitude, "by_magnitude", "topk_prune")
    if (k is None) == (ratio is None):
        raise ValueError("slimfit.topk_prune: give exactly one of k or ratio")
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
            raise TypeError(f"slimfit.topk_prune: ratio must be a float in (0, 1], got {ratio!r}")
        if not (0.0 < ratio <= 1.0):
            raise ValueError(f"slimfit.topk_prune: ratio must be in (0, 1], got {ratio}")
        k = max(1, math.ceil(ratio * x.shape[-1])) if x.dim() else 1
    check_topk_args(x, k)
    if check_finite and x.numel() and not bool(torch.isfinite(x).all()):
        _raise_non_finite("topk_prune", "an input entry is not finite")
    values, indices = ops.topk_prune(x, operator.index(k), by_magnitude)
    return PrunedTensor(values, indices, int(x.shape[-1]))


def topk_restore(p: PrunedTensor) -> torch.Tensor:
    if not isinstance(p, PrunedTensor):
        raise TypeError(f"slimfit.topk_restore: expected the PrunedTensor topk_prune returned, got {type(p).__name__}")
    return ops.topk_restore(p.values, p.indices, p.row_length)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    check_tensor(mask, "mask", "pack_bits")
    if mask.dtype != torch.bool:
        raise TypeError(f"slimfit.pack_bits: expected a bool mask, got {mask.dtype} (use mask != 0)")
    return ops.pack_bits(mask)


def unpack_bits(packed: torch.Tensor, shape) -> torch.Tensor:
    """The bool mask of `shape` that pack_bits packed into `packed`. The byte count must be the one
    pack_bits gives for that shape: a shape with fewer elements would silently read a prefix."""
    check_tensor(packed, "packed", "unpack_bits")
    if packed.dtype != torch.uint8:
        raise TypeError(f"slimfit.unpack_bits: expected uint8 packed bits, got {packed.dtype}")
    shape = check_shape(shape, "unpack_bits")
    numel = math.prod(shape)
    need = (numel + 7) // 8
    if packed.numel() != need:
        what = "cannot hold" if packed.numel() < need else "are more than"
        raise ValueError(f"slimfit.unpack_bits: {packed.numel()} bytes {what} the {numel} bits of shape {shape}, "
                         f"which pack_bits packs into {need} bytes; pass the shape of the mask that was packed")
    return ops.unpack_bits(packed, numel).view(shape)


def dropout_mask(like: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    check_tensor(like, "like", "dropout_mask")
    check_dropout_p(p)
    check_seed(seed, "dropout_mask")
    return ops.dropout_mask(like, float(p), operator.index(seed))


def seeded_dropout(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    check_float_input(x, "seeded_dropout")
    check_dropout_p(p)
    check_seed(seed, "seeded_dropout")
    return ops.seeded_dropout(x, float(p), operator.index(seed))
