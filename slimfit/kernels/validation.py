"""Argument checks shared by every backend, with errors that name the problem and the fix."""
from __future__ import annotations

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


def check_quant_args(bits: int, group_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"slimfit.quantize: bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(
            f"slimfit.quantize: group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}"
        )


def check_seed(seed: int, op: str) -> None:
    if not (0 <= int(seed) < 2**63):
        raise ValueError(f"slimfit.{op}: seed must be in [0, 2**63), got {seed}")


def check_topk_args(x: torch.Tensor, k: int) -> None:
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
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"slimfit.dropout: p must be in [0, 1], got {p}")


def codes_per_byte(bits: int) -> int:
    return 8 // bits


def packed_code_bytes(numel: int, bits: int) -> int:
    per = codes_per_byte(bits)
    return (numel + per - 1) // per


def num_groups(numel: int, group_size: int) -> int:
    return (numel + group_size - 1) // group_size
