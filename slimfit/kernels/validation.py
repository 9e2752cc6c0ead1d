"""Argument checks shared by every backend, with errors that name the problem and the fix."""
from __future__ import annotations

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
    """An integer that is not a bool (True/False for a count or a seed is a mistake, not 1/0)."""
    if isinstance(v, bool):
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
    if isinstance(p, bool) or not isinstance(p, (int, float)):
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
    if codes.numel() < packed_code_bytes(n, bits):
        raise ValueError(f"slimfit::{op}: {codes.numel()} code bytes cannot hold {n} elements at {bits} bits")
    ng = num_groups(n, group_size)
    if scale.numel() < ng or offset.numel() < ng:
        raise ValueError(f"slimfit::{op}: need {ng} groups of scale/offset for {n} elements (group_size "
                         f"{group_size}), got {scale.numel()} and {offset.numel()}")


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
    if row_length < 0:
        raise ValueError(f"slimfit::{op}: row_length must be >= 0, got {row_length}")
    if indices.numel() == 0:
        return
    if row_length == 0:
        raise ValueError(f"slimfit::{op}: indices point into rows of length 0")
    # A data-dependent check. On the CPU a host read is free (and the error is a ValueError); on an
    # accelerator, where this runs before every Triton restore, it must not wait for the host: a
    # device-side assertion fails the stream asynchronously instead of writing out of bounds.
    if indices.device.type == "cpu":
        if bool((indices < 0).any()) or bool((indices.to(torch.int64) >= row_length).any()):
            raise ValueError(f"slimfit::{op}: an index is outside [0, row_length={row_length})")
    else:
        inside = ((indices >= 0) & (indices.to(torch.int64) < row_length)).all()
        torch._assert_async(inside, f"slimfit::{op}: an index is outside [0, row_length={row_length})")


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


OP_CHECKS = {
    "quantize": op_quantize, "dequantize": op_dequantize, "topk_prune": op_topk_prune,
    "topk_restore": op_topk_restore, "pack_bits": op_pack_bits, "unpack_bits": op_unpack_bits,
    "dropout_mask": op_dropout_mask, "seeded_dropout": op_seeded_dropout,
}
