"""Row-wise top-k pruning and its inverse, in Triton.

topk_prune is a threshold search, not a sort. Each key (x, or |x|) is mapped to a uint32
whose unsigned order is the order torch.sort uses:
    +0.0 and -0.0 map to the same word (they compare equal), every NaN maps to 0xFFFFFFFF
    (NaN sorts above +inf, all NaNs tie), otherwise the usual radix-sort flip of the fp32
    bits (negative: all bits inverted; non-negative: sign bit set).
The k-th largest word T is found by bisection from the most significant bit down
(32 counting passes: keep bit b when at least k words are >= T | b). Then
    keep = (word > T) | (word == T and it is among the first k - count(word > T) ties)
which keeps the lowest indices among ties at the threshold, and kept entries are
compacted to ascending index order with an exclusive `tl.cumsum` of `keep`.

Two kernels:
  * rows up to REGISTER_ROW_MAX (8192): a [ROWS, BLOCK_N] tile of whole rows stays in registers
    through the 32 passes (several short rows per program);
  * longer rows (up to 65536): one program per row, every pass streams the row in chunks
    of CHUNK elements (the row stays hot in L1/L2). The chunk count is a constexpr (3 to 16
    for rows 8193..65536, so at most 14 compiled variants): static trip counts, and no
    loop over a runtime bound, which triton 3.6's interpreter cannot run under numpy 2.
topk_restore zero-fills the output (torch memset) and scatters the values with a flat
kernel, BLOCK values per program.
"""

import torch
import triton
import triton.language as tl

from ..validation import check_topk_args, topk_index_dtype
from ._common import on_device

# Sized from the sm_90 register report: <= 16 keys per thread keeps the tile kernel at
# <= 112 registers without spills; longer rows stream in chunks (8 keys per thread).
REGISTER_ROW_MAX = 8192
TILE_ELEMS = 2048     # elements per program for short rows (several rows per program)
CHUNK = 4096
CHUNK_WARPS = 16


class TileConfig:
    """Block shape of `_topk_tile_kernel` for rows of `row_len` (shared with bench/kernels_static.py)."""

    def __init__(self, row_len: int, n_rows: int):
        self.block_n = triton.next_power_of_2(row_len)
        self.rows = min(max(1, TILE_ELEMS // self.block_n), triton.next_power_of_2(n_rows))
        self.num_warps = min(16, max(1, self.rows * self.block_n // 256))  # 8 keys per thread, 16 at 8192
        self.loop_trips = [32]  # the bisection passes

    def constexprs(self, by_magnitude: bool) -> dict:
        return {"ROWS": self.rows, "BLOCK_N": self.block_n, "BY_MAGNITUDE": bool(by_magnitude)}

    def elements(self, row_len: int) -> int:
        return self.rows * row_len


def tile_config(row_len: int, n_rows: int) -> TileConfig:
    return TileConfig(row_len, n_rows)


def tile_signature(x_type: str, index_dtype: torch.dtype) -> dict:
    idx = {torch.int16: "*i16", torch.int32: "*i32"}[index_dtype]
    return {"x_ptr": x_type, "val_ptr": x_type, "idx_ptr": idx, "n_rows": "i32", "row_len": "i32", "k": "i32",
            "ROWS": "constexpr", "BLOCK_N": "constexpr", "BY_MAGNITUDE": "constexpr"}


def restore_signature(v_type: str, idx_type: str) -> dict:
    return {"val_ptr": v_type, "idx_ptr": idx_type, "out_ptr": v_type, "n_values": "i32", "row_len": "i32",
            "k": "i32", "BLOCK": "constexpr"}


@triton.jit
def _sort_word(x, BY_MAGNITUDE: tl.constexpr):
    """fp32 -> uint32 whose unsigned order is torch.sort's order of the key."""
    key = tl.abs(x) if BY_MAGNITUDE else x
    key = tl.where(key == 0.0, 0.0, key)                    # -0.0 ties with +0.0
    bits = key.to(tl.int32, bitcast=True)
    u = key.to(tl.uint32, bitcast=True)
    ones = tl.full((), 0xFFFFFFFF, tl.uint32)  # (not `~u`: triton 3.6's interpreter rejects it)
    sign = tl.full((), 0x80000000, tl.uint32)
    word = tl.where(bits < 0, u ^ ones, u | sign)
    return tl.where(key != key, ones, word)                 # NaN: largest


@triton.jit
def _topk_tile_kernel(
    x_ptr, val_ptr, idx_ptr,
    n_rows, row_len, k,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BY_MAGNITUDE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)                               # [R] int64
    cols = tl.arange(0, BLOCK_N)                                         # [N] int32
    inside = (rows < n_rows)[:, None] & (cols < row_len)[None, :]
    x = tl.load(x_ptr + rows[:, None] * row_len + cols[None, :], mask=inside, other=0.0)
    # Padding gets word 0, below every real key (-inf maps to 0x007FFFFF), and every
    # candidate threshold is >= 1, so padding is never counted or kept.
    word = tl.where(inside, _sort_word(x.to(tl.float32), BY_MAGNITUDE), 0)

    thr = tl.zeros([ROWS], dtype=tl.uint32)
    bit = tl.full([ROWS], 0x80000000, tl.uint32)
    for _ in range(32):
        cand = thr | bit
        cnt = tl.sum((word >= cand[:, None]).to(tl.int32), axis=1)
        thr = tl.where(cnt >= k, cand, thr)
        bit = bit >> 1

    above = word > thr[:, None]
    tie = (word == thr[:, None]) & inside
    need = k - tl.sum(above.to(tl.int32), axis=1)                       # >= 1 ties to keep
    tie_rank = tl.cumsum(tie.to(tl.int32), axis=1)                      # 1-based among ties
    keep = above | (tie & (tie_rank <= need[:, None]))
    pos = tl.cumsum(keep.to(tl.int32), axis=1) - 1
    out = rows[:, None] * k + pos
    tl.store(val_ptr + out, x, mask=keep)
    col = tl.broadcast_to(cols[None, :], [ROWS, BLOCK_N])
    tl.store(idx_ptr + out, col.to(idx_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _topk_long_row_kernel(
    x_ptr, val_ptr, idx_ptr,
    row_len, k,
    CHUNK: tl.constexpr, N_CHUNKS: tl.constexpr, BY_MAGNITUDE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * row_len
    cols = tl.arange(0, CHUNK)

    thr = tl.full((), 0, tl.uint32)
    bit = tl.full((), 0x80000000, tl.uint32)
    for _ in range(32):
        cand = thr | bit
        cnt = tl.full((), 0, tl.int32)
        for ci in range(N_CHUNKS):
            c = ci * CHUNK + cols
            x = tl.load(x_row + c, mask=c < row_len, other=0.0)
            word = tl.where(c < row_len, _sort_word(x.to(tl.float32), BY_MAGNITUDE), 0)
            cnt += tl.sum((word >= cand).to(tl.int32), axis=0)
        thr = tl.where(cnt >= k, cand, thr)
        bit = bit >> 1

    n_above = tl.full((), 0, tl.int32)
    for ci in range(N_CHUNKS):
        c = ci * CHUNK + cols
        x = tl.load(x_row + c, mask=c < row_len, other=0.0)
        word = tl.where(c < row_len, _sort_word(x.to(tl.float32), BY_MAGNITUDE), 0)
        n_above += tl.sum((word > thr).to(tl.int32), axis=0)
    need = k - n_above

    ties_seen = tl.full((), 0, tl.int32)
    kept = tl.full((), 0, tl.int32)
    for ci in range(N_CHUNKS):
        c = ci * CHUNK + cols
        inside = c < row_len
        x = tl.load(x_row + c, mask=inside, other=0.0)
        word = tl.where(inside, _sort_word(x.to(tl.float32), BY_MAGNITUDE), 0)
        above = word > thr
        tie = (word == thr) & inside
        tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0)
        keep = above | (tie & (tie_rank <= need))
        keep_i = keep.to(tl.int32)
        pos = kept + tl.cumsum(keep_i, axis=0) - 1
        out = row * k + pos
        tl.store(val_ptr + out, x, mask=keep)
        tl.store(idx_ptr + out, c.to(idx_ptr.dtype.element_ty), mask=keep)
        ties_seen += tl.sum(tie.to(tl.int32), axis=0)
        kept += tl.sum(keep_i, axis=0)


def topk_prune(x: torch.Tensor, k: int, by_magnitude: bool):
    check_topk_args(x, k)
    row_len = x.shape[-1]
    lead = tuple(x.shape[:-1])
    index_dtype = topk_index_dtype(row_len)
    if row_len == 0:  # the reference keeps min(k, 0) = 0 entries per row
        return x.new_empty(lead + (0,)), torch.empty(lead + (0,), dtype=index_dtype, device=x.device)
    values = torch.empty(lead + (k,), dtype=x.dtype, device=x.device)
    indices = torch.empty(lead + (k,), dtype=index_dtype, device=x.device)
    n_rows = x.numel() // row_len
    if n_rows == 0:
        return values, indices
    x = x.contiguous()
    if row_len <= REGISTER_ROW_MAX:
        cfg = tile_config(row_len, n_rows)
        grid = (triton.cdiv(n_rows, cfg.rows),)
        with on_device(x):
            _topk_tile_kernel[grid](
                x, values, indices,
                n_rows, row_len, k,
                **cfg.constexprs(by_magnitude),
                num_warps=cfg.num_warps, enable_fp_fusion=False,
            )
    else:
        with on_device(x):
            _topk_long_row_kernel[(n_rows,)](
                x, values, indices,
                row_len, k,
                CHUNK=CHUNK, N_CHUNKS=triton.cdiv(row_len, CHUNK), BY_MAGNITUDE=bool(by_magnitude),
                num_warps=CHUNK_WARPS, enable_fp_fusion=False,
            )
    return values, indices


@triton.jit
def _topk_restore_kernel(
    val_ptr, idx_ptr, out_ptr,
    n_values, row_len, k,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n_values
    v = tl.load(val_ptr + offs, mask=inside, other=0)
    col = tl.load(idx_ptr + offs, mask=inside, other=0).to(tl.int64)
    row = offs // k
    # Indices outside [0, row_len) are dropped instead of writing out of bounds.
    ok = inside & (col >= 0) & (col < row_len)
    tl.store(out_ptr + row * row_len + col, v, mask=ok)


RESTORE_BLOCK = 1024
RESTORE_WARPS = 4


def topk_restore(values: torch.Tensor, indices: torch.Tensor, row_length: int):
    if values.dim() == 0:
        raise ValueError("slimfit.topk_restore: values must have at least one dimension")
    if indices.shape != values.shape:
        raise ValueError(
            f"slimfit.topk_restore: indices shape {tuple(indices.shape)} differs from values "
            f"shape {tuple(values.shape)}"
        )
    if indices.dtype not in (torch.int16, torch.int32, torch.int64):
        raise TypeError(f"slimfit.topk_restore: indices must be int16/int32/int64, got {indices.dtype}")
    row_length = int(row_length)
    n = values.numel()
    if row_length == 0 and n:  # the reference's scatter raises too; never an empty tensor
        raise ValueError(f"slimfit.topk_restore: row_length is 0 but each row has {values.shape[-1]} kept "
                         "entries; pass the pruned tensor's row length (PrunedTensor.row_length)")
    out = values.new_zeros(values.shape[:-1] + (row_length,))
    if n == 0:
        return out
    k = values.shape[-1]
    values = values.contiguous()
    indices = indices.contiguous()
    grid = (triton.cdiv(n, RESTORE_BLOCK),)
    with on_device(out):
        _topk_restore_kernel[grid](
            values, indices, out,
            n, row_length, k,
            BLOCK=RESTORE_BLOCK, num_warps=RESTORE_WARPS, enable_fp_fusion=False,
        )
    return out
