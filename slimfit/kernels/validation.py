"""Argument checks shared by every backend, with errors that name the problem and the fix."""
from __future__ import annotations

import numbers
import operator

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128, 256)
INT16_MAX_ROW = 32768  # indices 0..32767 fit int16
MAX_TOPK_ROW = 65536


def check_float_input(x: torch.Tensor, op: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"slimfit.{op}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"slimfit.{op}: unsupported dtype {x.dtype}; use float32, float16 or bfloat16 "
            f"(convert with x.float())"
        )


def _is_int(v) -> bool:
    """An integer that is not a bool (True/False for a count or a seed is a mistake, not 1/0;
    a bool tensor is a bool too, though it has __index__)."""
    if isinstance(v, bool) or (isinstance(v, torch.Tensor) and v.dtype == torch.bool):
        return False
    try:
        operator.index(v)
    except TypeError:
        return False
    return True


def check_quant_args(bits: int, group_size: int) -> None:
    if not _is_int(bits):
        raise TypeError(f"slimfit.quantize: bits must be an int (2, 4 or 8), got {bits!r}")
    if not _is_int(group_size):
        raise TypeError(f"slimfit.quantize: group_size must be an int ({SUPPORTED_GROUP_SIZES}), got {group_size!r}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"slimfit.quantize: bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(
            f"slimfit.quantize: group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}"
        )


def check_flag(value, name: str, op: str) -> bool:
    """`value` as a bool: True/False (numpy's too) or the ints 0/1. Anything else is refused, since
    bool() would silently read a string such as "False" or a None as a choice."""
    if isinstance(value, bool):
        return value
    if getattr(getattr(value, "dtype", None), "kind", None) == "b" and getattr(value, "ndim", None) == 0:
        return bool(value)  # a numpy bool
    if _is_int(value) and operator.index(value) in (0, 1):
        return bool(operator.index(value))
    raise TypeError(f"slimfit.{op}: {name} must be True or False, got {value!r}")


def check_tensor(t, name: str, op: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"slimfit.{op}: {name} must be a torch.Tensor, got {type(t).__name__}")


def check_shape(shape, op: str) -> tuple:
    """A shape (an int or a sequence of ints >= 0) as a tuple of ints."""
    dims = (shape,) if _is_int(shape) else shape
    try:
        dims = tuple(dims)
    except TypeError:
        raise TypeError(f"slimfit.{op}: shape must be an int or a sequence of ints, got {shape!r}") from None
    if not all(_is_int(d) for d in dims):
        raise TypeError(f"slimfit.{op}: shape must be a sequence of ints, got {shape!r}")
    dims = tuple(operator.index(d) for d in dims)
    if any(d < 0 for d in dims):
        raise ValueError(f"slimfit.{op}: negative dimension in shape {dims}")
    return dims


def check_seed(seed: int, op: str) -> None:
    if not _is_int(seed):
        raise TypeError(f"slimfit.{op}: seed must be an int in [0, 2**63), got {seed!r}")
    if not (0 <= int(seed) < 2**63):
        raise ValueError(f"slimfit.{op}: seed must be in [0, 2**63), got {seed}")


def check_topk_args(x: torch.Tensor, k: int) -> None:
    if not _is_int(k):
        raise TypeError(f"slimfit.topk_prune: k must be an int (entries kept per row), got {k!r}")
    k = operator.index(k)
    if x.dim() == 0:
        raise ValueError("slimfit.topk_prune: input must have at least one dimension (rows are the last dimension)")
    row = x.shape[-1]
    if row > MAX_TOPK_ROW:
        raise ValueError(f"slimfit.topk_prune: row length {row} exceeds the supported maximum {MAX_TOPK_ROW}")
    if not (1 <= k <= max(row, 1)):
        raise ValueError(f"slimfit.topk_prune: k must be in [1, row length={row}], got {k}")


def topk_index_dtype(row_length: int) -> torch.dtype:
    return torch.int16 if row_length <= INT16_MAX_ROW else torch.int32


def check_dropout_p(p: float) -> None:
    # numbers.Real: Python and numpy floats and ints (np.float32 is not a float subclass)
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"slimfit.dropout: p must be a float in [0, 1], got {p!r}")
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"slimfit.dropout: p must be in [0, 1], got {p}")


def codes_per_byte(bits: int) -> int:
    return 8 // bits


def packed_code_bytes(numel: int, bits: int) -> int:
    per = codes_per_byte(bits)
    return (numel + per - 1) // per


def num_groups(numel: int, group_size: int) -> int:
    return (numel + group_size - 1) // group_size


# ---------------------------------------------------------------- op-level checks
# The checks the C++ kernels make (csrc/cpu/*.cpp), for the backends that are Python: the reference
# (every device other than CPU and CUDA, and SLIMFIT_BACKEND=reference) and the Triton launchers.
# _ops.py runs them before those kernels, so a bad call fails the same way on every backend.
_OP_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _op_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in _OP_FLOATS:
        raise TypeError(f"slimfit::{op}: unsupported dtype {t.dtype} for {name}; use float32, float16 or bfloat16")


def _op_p(op: str, p: float) -> None:
    if not (0.0 <= p <= 1.0):  # NaN fails too
        raise ValueError(f"slimfit::{op}: p must be in [0, 1], got {p}")


def _op_bits_group(op: str, bits: int, group_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"slimfit::{op}: bits must be 2, 4 or 8, got {bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"slimfit::{op}: group_size must be 32, 64, 128 or 256, got {group_size}")


def _op_same_device(op: str, **tensors) -> None:
    devices = {k: t.device for k, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"slimfit::{op}: tensors on different devices ({devices}); move them to one device")


def op_quantize(x, bits, group_size, stochastic, seed) -> None:
    _op_float("quantize", "x", x)
    _op_bits_group("quantize", bits, group_size)


def op_dequantize(codes, scale, offset, bits, group_size, shape, dtype) -> None:
    op = "dequantize"
    _op_same_device(op, codes=codes, scale=scale, offset=offset)
    if codes.dtype != torch.uint8:
        raise TypeError(f"slimfit::{op}: codes must be uint8, got {codes.dtype}")
    if scale.dtype != torch.float32 or offset.dtype != torch.float32:
        raise TypeError(f"slimfit::{op}: scale and offset must be float32, got {scale.dtype} and {offset.dtype}")
    if dtype not in _OP_FLOATS + (torch.float64,):
        raise TypeError(f"slimfit::{op}: unsupported output dtype {dtype}; use float32, float16, bfloat16 or float64")
    _op_bits_group(op, bits, group_size)
    n = 1
    for d in shape:
        if int(d) < 0:
            raise ValueError(f"slimfit::{op}: negative dimension in shape {list(shape)}")
        n *= int(d)
    _op_quantized_sizes(op, codes.numel(), scale.numel(), offset.numel(), n, bits, group_size, shape)


def _op_quantized_sizes(op, n_codes, n_scale, n_offset, n, bits, group_size, shape) -> None:
    """The parts of a quantized tensor have exactly the sizes its shape, bits and group_size give
    (quantize makes them so). Checked before anything is allocated: a wrong shape must neither try
    to allocate its elements (2**40 of them for 300 codes) nor read a prefix, and wrong bits must
    not read 8-bit codes as 4-bit ones."""
    fix = ("pass the shape, bits and group_size the tensor was quantized with "
           "(QuantizedTensor.shape, .bits, .group_size)")
    need = packed_code_bytes(n, bits)
    if n_codes != need:
        raise ValueError(f"slimfit::{op}: {n_codes} code bytes do not match the {n} elements of shape "
                         f"{list(shape)} at {bits} bits ({need} bytes); {fix}")
    ng = num_groups(n, group_size)
    if n_scale != ng or n_offset != ng:
        raise ValueError(f"slimfit::{op}: need {ng} groups of scale/offset for {n} elements (group_size "
                         f"{group_size}), got {n_scale} and {n_offset}; {fix}")


def op_topk_prune(x, k, by_magnitude) -> None:
    op = "topk_prune"
    _op_float(op, "x", x)
    if x.dim() < 1:
        raise ValueError(f"slimfit::{op}: input must have at least one dimension (rows are the last one)")
    row = x.shape[-1]
    if not (k >= 0 and (k <= row or row == 0)):
        raise ValueError(f"slimfit::{op}: k must be in [0, row length={row}], got {k}")


def op_topk_restore(values, indices, row_length) -> None:
    op = "topk_restore"
    _op_same_device(op, values=values, indices=indices)
    if values.dim() < 1:
        raise ValueError(f"slimfit::{op}: values must have at least one dimension")
    if values.shape != indices.shape:
        raise ValueError(f"slimfit::{op}: values {list(values.shape)} and indices {list(indices.shape)} must have "
                         "the same shape")
    if indices.dtype not in (torch.int16, torch.int32, torch.int64):
        raise TypeError(f"slimfit::{op}: indices must be int16, int32 or int64, got {indices.dtype}")
    if values.is_complex() or values.element_size() > 8:
        raise TypeError(f"slimfit::{op}: unsupported values dtype {values.dtype}; use a real dtype (restore "
                        "values.real and values.imag separately)")
    if row_length < 0:
        raise ValueError(f"slimfit::{op}: row_length must be >= 0, got {row_length}")
    if indices.numel() == 0:
        return
    k = values.shape[-1]
    if row_length == 0:
        raise ValueError(f"slimfit::{op}: indices point into rows of length 0")
    if k > row_length:  # k distinct positions need rows of at least k
        raise ValueError(f"slimfit::{op}: row_length={row_length} cannot hold the {k} kept entries of each row; "
                         "pass the pruned tensor's row length (PrunedTensor.row_length)")
    _op_restore_indices(op, indices, row_length)


def _op_restore_indices(op, indices, row_length) -> None:
    """Every index inside [0, row_length) and strictly ascending along its row (as topk_prune gives
    them): a repeated index would leave which value lands there to the backend. A data-dependent check.
    On the CPU a host read is free (and the error is a ValueError); on an accelerator, where this runs
    before every Triton restore, it must not wait for the host: a device-side assertion fails the
    stream asynchronously instead of writing out of bounds."""
    wide = indices.to(torch.int64)
    inside = (wide >= 0) & (wide < row_length)
    ascending = wide[..., 1:] > wide[..., :-1]
    where = f"an index is outside [0, row_length={row_length})"
    order = ("the indices of a row are not strictly ascending (a repeated index?); pass them as topk_prune "
             "returns them (sort each row's indices and values alike)")
    if indices.device.type == "cpu":
        if not bool(inside.all()):
            raise ValueError(f"slimfit::{op}: {where}")
        if not bool(ascending.all()):
            raise ValueError(f"slimfit::{op}: {order}")
    else:
        torch._assert_async(inside.all(), f"slimfit::{op}: {where}")
        torch._assert_async(ascending.all(), f"slimfit::{op}: {order}")


def op_pack_bits(mask) -> None:
    if mask.dtype != torch.bool:
        raise TypeError(f"slimfit::pack_bits: expected a bool mask, got {mask.dtype} (use mask != 0)")


def op_unpack_bits(packed, numel) -> None:
    op = "unpack_bits"
    if packed.dtype != torch.uint8:
        raise TypeError(f"slimfit::{op}: expected uint8 packed bits, got {packed.dtype}")
    if numel < 0:
        raise ValueError(f"slimfit::{op}: numel must be >= 0, got {numel}")
    if packed.numel() < (numel + 7) // 8:
        raise ValueError(f"slimfit::{op}: {packed.numel()} bytes cannot hold {numel} bits")


def op_dropout_mask(like, p, seed) -> None:
    _op_p("dropout_mask", p)


def op_seeded_dropout(x, p, seed) -> None:
    _op_float("seeded_dropout", "x", x)
    _op_p("seeded_dropout", p)


def op_round_stochastic(x, dtype, seed) -> None:
    if x.dtype != torch.float32:
        raise TypeError(f"slimfit::round_stochastic: x must be float32 (the values to round), got {x.dtype}")
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"slimfit::round_stochastic: rounds to bfloat16 or float16, got {dtype}; float32 "
                        "values need no rounding")


# ---------------------------------------------------------------- block-wise dynamic quantization
BLOCKWISE_BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
QMAP_LEVELS = (16, 256)   # 4- or 8-bit codes


def blockwise_bits(qmap: torch.Tensor) -> int:
    """The code width of a map: 4 bits for 16 levels, 8 for 256."""
    return 4 if qmap.numel() == 16 else 8


def _op_block_size(op: str, block_size: int) -> None:
    if block_size not in BLOCKWISE_BLOCK_SIZES:
        raise ValueError(f"slimfit::{op}: block_size must be one of {BLOCKWISE_BLOCK_SIZES}, got {block_size}")


def _op_qmap(op: str, qmap: torch.Tensor) -> None:
    """A map is a 1-D fp32 tensor of 16 or 256 finite, strictly increasing levels (slimfit.kernels.qmaps).
    Its order is read on the CPU (256 values); on an accelerator a device-side assertion checks it without
    waiting for the host. A map object checked once is not checked again until it is modified in place
    (its version counter moves): the codec passes the same cached maps at every call."""
    if qmap.dtype != torch.float32 or qmap.dim() != 1 or qmap.numel() not in QMAP_LEVELS:
        raise ValueError(f"slimfit::{op}: qmap must be a 1-D float32 tensor of 16 or 256 levels (4- or 8-bit "
                         f"codes; slimfit.kernels.qmaps), got {qmap.dtype} of shape {list(qmap.shape)}")
    if getattr(qmap, "fake_mode", None) is not None or qmap.device.type == "meta":
        return   # no values to read (fake tensors: shapes only)
    version = _version(qmap)
    if version is not None and getattr(qmap, "_slimfit_checked", None) == version:
        return
    ok = torch.isfinite(qmap).all() & (qmap[1:] > qmap[:-1]).all()
    what = f"slimfit::{op}: qmap must be finite and strictly increasing (a sorted map of levels)"
    if qmap.device.type == "cpu":
        if not bool(ok):
            raise ValueError(what)
    else:
        torch._assert_async(ok, what)
    if version is not None:
        qmap._slimfit_checked = version


def _version(t: torch.Tensor):
    """t's version counter (moves at every in-place change), None where it has none (inference tensors)."""
    try:
        return t._version
    except RuntimeError:
        return None


def op_quantize_blockwise(x, qmap, block_size, stochastic=False, seed=0) -> None:
    op = "quantize_blockwise"
    _op_float(op, "x", x)
    _op_same_device(op, x=x, qmap=qmap)
    _op_block_size(op, block_size)
    _op_qmap(op, qmap)


def op_dequantize_blockwise(codes, absmax, qmap, block_size, shape, dtype) -> None:
    op = "dequantize_blockwise"
    _op_same_device(op, codes=codes, absmax=absmax, qmap=qmap)
    if codes.dtype != torch.uint8:
        raise TypeError(f"slimfit::{op}: codes must be uint8, got {codes.dtype}")
    if absmax.dtype != torch.float32:
        raise TypeError(f"slimfit::{op}: absmax must be float32, got {absmax.dtype}")
    if dtype not in _OP_FLOATS + (torch.float64,):
        raise TypeError(f"slimfit::{op}: unsupported output dtype {dtype}; use float32, float16, bfloat16 or float64")
    _op_block_size(op, block_size)
    _op_qmap(op, qmap)
    n = 1
    for d in shape:
        if int(d) < 0:
            raise ValueError(f"slimfit::{op}: negative dimension in shape {list(shape)}")
        n *= int(d)
    bits = blockwise_bits(qmap)
    fix = "pass the shape, qmap and block_size the tensor was quantized with"
    need = packed_code_bytes(n, bits)
    if codes.numel() != need:
        raise ValueError(f"slimfit::{op}: {codes.numel()} code bytes do not match the {n} elements of shape "
                         f"{list(shape)} at {bits} bits ({need} bytes); {fix}")
    nb = num_groups(n, block_size)
    if absmax.numel() != nb:
        raise ValueError(f"slimfit::{op}: need {nb} block maxima for {n} elements (block_size {block_size}), got "
                         f"{absmax.numel()}; {fix}")


def _op_score_sums(op, params, score_sums, score, block_size) -> None:
    if score not in (0, 1, 2, 3):
        raise ValueError(f"slimfit::{op}: score must be 0 (none), 1 (relative), 2 (robust) or 3 (absolute), got "
                         f"{score}")
    if not score:
        if len(score_sums):
            raise ValueError(f"slimfit::{op}: score_sums given with score 0; pass a score kind, or no sums")
        return
    if len(score_sums) != len(params):
        raise ValueError(f"slimfit::{op}: score_sums has {len(score_sums)} entries for {len(params)} params; pass one "
                         "per piece (an empty tensor for a piece not scored)")
    for j, (p, s) in enumerate(zip(params, score_sums)):
        nb = num_groups(p.numel(), block_size)
        if s.numel() and (s.dtype != torch.float32 or tuple(s.shape) != (3, nb) or not s.is_contiguous()
                          or s.device != p.device):
            raise ValueError(f"slimfit::{op}: score_sums[{j}] must be empty or a contiguous float32 (3, {nb}) on "
                             f"{p.device}, got {s.dtype} of shape {tuple(s.shape)} on {s.device}")


def op_adam_blockwise_(params, grads, m_codes, m_absmax, v_codes, v_absmax, qmap_m, qmap_v, step_sizes, decays,
                       bc2_sqrts, beta1, beta2, eps, weight_decay, decoupled, block_size, stochastic, seeds, offsets,
                       round_weights, score_sums=(), score=0) -> None:
    """Every list one entry per piece (seeds three), each piece a contiguous float tensor whose gradient has
    its size, its moments 8- or 4-bit codes (one or half a byte an element, as the maps' 256 or 16 levels say) and
    fp32 block maxima of that size, on one device;
    with a score kind, score_sums one entry per piece, each empty or a contiguous fp32 (3, blocks)."""
    op = "adam_blockwise_"
    n = len(params)
    lists = {"grads": grads, "m_codes": m_codes, "m_absmax": m_absmax, "v_codes": v_codes, "v_absmax": v_absmax,
             "step_sizes": step_sizes, "decays": decays, "bc2_sqrts": bc2_sqrts, "offsets": offsets}
    for name, items in lists.items():
        if len(items) != n:
            raise ValueError(f"slimfit::{op}: {name} has {len(items)} entries for {n} params; pass one per piece")
    if len(seeds) != 3 * n:
        raise ValueError(f"slimfit::{op}: seeds has {len(seeds)} entries for {n} params; pass three per piece "
                         "(first moment, second moment, weight rounding)")
    _op_block_size(op, block_size)
    _op_score_sums(op, params, score_sums, score, block_size)
    for qmap in (qmap_m, qmap_v):
        _op_qmap(op, qmap)
        if qmap.numel() != qmap_m.numel():
            raise ValueError(f"slimfit::{op}: qmap_m has {qmap_m.numel()} levels and qmap_v {qmap_v.numel()}; "
                             "both moments take one code width (16 levels: 4 bits, 256: 8 bits)")
    bits = blockwise_bits(qmap_m)
    for j in range(n):
        p, g = params[j], grads[j]
        _op_float(op, "params", p)
        _op_float(op, "grads", g)
        _op_same_device(op, param=p, grad=g, m_codes=m_codes[j], m_absmax=m_absmax[j], v_codes=v_codes[j],
                        v_absmax=v_absmax[j], qmap_m=qmap_m)
        if not p.is_contiguous():
            raise ValueError(f"slimfit::{op}: params[{j}] is not contiguous; pass contiguous pieces (view(-1) slices)")
        k = p.numel()
        if g.numel() != k:
            raise ValueError(f"slimfit::{op}: grads[{j}] has {g.numel()} elements, its param {k}")
        for name, codes, absmax in (("m", m_codes[j], m_absmax[j]), ("v", v_codes[j], v_absmax[j])):
            if codes.dtype != torch.uint8 or codes.numel() != packed_code_bytes(k, bits):
                raise ValueError(f"slimfit::{op}: {name}_codes[{j}] must be uint8 with the {bits}-bit codes of its "
                                 f"{k} elements ({packed_code_bytes(k, bits)} bytes), got {codes.dtype} of "
                                 f"{codes.numel()}")
            if absmax.dtype != torch.float32 or absmax.numel() != num_groups(k, block_size):
                raise ValueError(f"slimfit::{op}: {name}_absmax[{j}] must be float32 with one maximum per block "
                                 f"({num_groups(k, block_size)}), got {absmax.dtype} of {absmax.numel()}")
            if not codes.is_contiguous() or not absmax.is_contiguous():
                raise ValueError(f"slimfit::{op}: {name}_codes[{j}] and {name}_absmax[{j}] must be contiguous")


OP_CHECKS = {
    "quantize": op_quantize, "dequantize": op_dequantize, "topk_prune": op_topk_prune,
    "topk_restore": op_topk_restore, "pack_bits": op_pack_bits, "unpack_bits": op_unpack_bits,
    "dropout_mask": op_dropout_mask, "seeded_dropout": op_seeded_dropout,
    "quantize_blockwise": op_quantize_blockwise, "dequantize_blockwise": op_dequantize_blockwise,
    "round_stochastic": op_round_stochastic, "adam_blockwise_": op_adam_blockwise_,
}
