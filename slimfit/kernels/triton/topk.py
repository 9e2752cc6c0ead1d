"""Row-wise top-k pruning and its inverse, in Triton.

topk_prune is a radix select, not a sort. Each key (x, or |x|) is mapped to a uint32 word
whose unsigned order is the order torch.sort uses:
    +0.0 and -0.0 map to the same word (they compare equal), every NaN maps to 0xFFFFFFFF
    (NaN sorts above +inf, all NaNs tie), otherwise the usual radix-sort flip of the fp32
    bits (negative: all bits inverted; non-negative: sign bit set).
The k-th largest word T of a row is found 8 bits at a time, most significant digit first, in
4 passes. Pass p builds the 256-bin histogram (`tl.histogram`) of digit p of the words whose
digits 0..p-1 equal the prefix of T found so far; a cumulative sum from the top bin gives
digit p of T: the one bin d with count(digit > d) < k_left <= count(digit >= d), where
k_left is k minus the words already known to be above T. After pass 3, k_left is the number
of ties (word == T) to keep:
    keep = (word > T) | (word == T and it is among the first k_left ties)
which keeps the lowest indices among ties at the threshold; kept entries are compacted to
ascending index order with one `tl.cumsum` (of the packed counts of words above T and of
ties). The output equals reference.topk_prune (a stable descending sort) bit for bit.

One program per row; the row is processed in N_CHUNKS chunks of CHUNK lanes, 8 per thread
(4 histogram passes and 1 compaction pass over the chunks; a row of one chunk is loaded once
and stays in registers, a longer one is read again each pass, from L1/L2). `tile_config` picks
the chunk that wastes the fewest lanes, so rows are not padded to a power of two: 768 =
3 x 256 lanes, 3000 = 3 x 1024, 2048 = 1 x 2048; EVEN rows (a whole number of chunks) run
without masks. Rows that are not a multiple of 256 keep some masked lanes: 197 takes one chunk
of 256 (chunks of 32 would waste less but cost more: each chunk's histogram is 256 bins).
One row per program: several short rows in one program (a flat tile, bins row * 256 + digit)
need per-row scans and reductions of [rows, 256] histograms across warps, which cost more SASS
instructions and registers than the masked lanes they save. Trip counts are constexprs: no loop
over a runtime bound, which triton 3.6's interpreter cannot run under numpy 2.

`tl.histogram` (with a mask) works in triton 3.6 to 3.9 and in their interpreters. Triton 3.6
and 3.7 lower it with warp ballots whose cost grows with the bins (there a 256-bin histogram is
most of this kernel's instructions); 3.8 and later count with one warp-aggregated shared-memory
atomic per element. The sm_90a cost per row length (triton 3.9): bench/results/kernels_static_sm90.md
(`python -m bench.kernels_static --only topk`).

topk_restore writes whole rows in one kernel: each program stores the zeros of its rows,
then (after a barrier) their kept values; ROWS short rows per program (contiguous in memory,
an element's row found by `_row_of`), or one long row in chunks. No separate memset.
"""

import torch
import triton
import triton.language as tl

from ..validation import op_topk_prune, topk_index_dtype
from ._common import on_device

REGISTER_ROW_MAX = 8192   # rows up to this length pick their chunk freely (one chunk: in registers)
CHUNK = 4096              # chunk of longer rows (up to 65536: at most 16 chunks)
MIN_CHUNK = 256           # one chunk's histogram is 256 bins: smaller chunks only for shorter rows
KEYS_PER_THREAD = 8       # lanes per thread (16 in a chunk of 8192)
MAX_WARPS = 16


def _warps(lanes: int) -> int:
    return min(MAX_WARPS, max(1, lanes // (32 * KEYS_PER_THREAD)))


def _chunk(row_len: int) -> int:
    """The chunk (a power of two) that covers a row with the fewest lanes; ties: the larger."""
    if row_len > REGISTER_ROW_MAX:
        return CHUNK
    whole = triton.next_power_of_2(max(row_len, 16))
    if whole <= MIN_CHUNK:
        return whole
    sizes = [c for c in (2 ** i for i in range(8, 14)) if MIN_CHUNK <= c <= whole]
    return min(sizes, key=lambda c: (triton.cdiv(row_len, c) * c, -c))


class TileConfig:
    """Chunking of `_topk_kernel` for rows of `row_len` (shared with bench/kernels_static.py):
    one row per program, `n_chunks` chunks of `block` lanes (n_rows does not matter: one
    compiled variant per row length)."""

    def __init__(self, row_len: int, n_rows: int = 1):
        self.row_len = row_len
        self.block = _chunk(row_len)
        self.n_chunks = triton.cdiv(max(row_len, 1), self.block)
        self.rows = 1
        self.num_warps = _warps(self.block)
        # loops of the SASS in address order: 4 histogram passes and the compaction pass, each
        # over the chunks (a compiler may unroll some; kernels_static handles that)
        self.loop_trips = [self.n_chunks] * 5 if self.n_chunks > 1 else []

    def constexprs(self, by_magnitude: bool) -> dict:
        return {"CHUNK": self.block, "N_CHUNKS": self.n_chunks, "BY_MAGNITUDE": bool(by_magnitude),
                "EVEN": self.row_len == self.block * self.n_chunks}

    def elements(self, row_len: int) -> int:
        return self.rows * row_len

    def grid(self, n_rows: int) -> tuple[int]:
        return (n_rows,)


def tile_config(row_len: int, n_rows: int = 1) -> TileConfig:
    return TileConfig(row_len, n_rows)


def tile_signature(x_type: str, index_dtype: torch.dtype) -> dict:
    idx = {torch.int16: "*i16", torch.int32: "*i32"}[index_dtype]
    return {"x_ptr": x_type, "val_ptr": x_type, "idx_ptr": idx, "row_len": "i32", "k": "i32",
            "CHUNK": "constexpr", "N_CHUNKS": "constexpr", "BY_MAGNITUDE": "constexpr", "EVEN": "constexpr"}


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
def _select_digit(hist, k_left):
    """hist [256]: counts of the alive words of a row by digit; k_left (>= 1): rank of the
    wanted word among them, from the largest. Returns (its digit d, count(digit > d)): d is
    the one bin with count(> d) < k_left <= count(>= d), found with a cumulative sum from the
    top bin and one reduction of a packed value (d in the low 8 bits)."""
    above = tl.cumsum(hist, axis=0, reverse=True) - hist               # count(digit > b)
    is_d = (above < k_left) & (above + hist >= k_left)
    packed = tl.sum(tl.where(is_d, tl.arange(0, 256) + above * 256, 0), axis=0)  # above <= 65536
    return packed & 0xFF, packed >> 8


@triton.jit
def _topk_kernel(
    x_ptr, val_ptr, idx_ptr,
    row_len, k,
    CHUNK: tl.constexpr, N_CHUNKS: tl.constexpr, BY_MAGNITUDE: tl.constexpr, EVEN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * row_len
    cols = tl.arange(0, CHUNK)

    prefix = tl.full((), 0, tl.uint32)    # digits of the threshold found so far
    k_left = k
    for p in tl.static_range(4):
        hist = tl.zeros([256], dtype=tl.int32)
        for ci in range(N_CHUNKS):
            c = ci * CHUNK + cols
            inside = (c < row_len) | EVEN                 # EVEN: row_len = N_CHUNKS * CHUNK, no masks
            x = tl.load(x_row + c, mask=None if EVEN else inside, other=None if EVEN else 0.0)
            word = _sort_word(x.to(tl.float32), BY_MAGNITUDE)
            if p == 0:
                alive = inside
            else:
                alive = inside & ((word >> (32 - 8 * p)) == prefix)
            digit = ((word >> (24 - 8 * p)) & 0xFF).to(tl.int32)
            hist += tl.histogram(digit, 256, mask=alive)
        d, n_above = _select_digit(hist, k_left)
        k_left -= n_above
        prefix = (prefix << 8) | d.to(tl.uint32)
    thr = prefix
    need = k_left                         # ties to keep

    above_seen = tl.full((), 0, tl.int32)
    ties_seen = tl.full((), 0, tl.int32)
    for ci in range(N_CHUNKS):
        c = ci * CHUNK + cols
        inside = (c < row_len) | EVEN
        x = tl.load(x_row + c, mask=None if EVEN else inside, other=None if EVEN else 0.0)
        word = _sort_word(x.to(tl.float32), BY_MAGNITUDE)
        above = (word > thr) & inside
        tie = (word == thr) & inside
        # one scan of the packed counts: low 16 bits words above T, high bits ties (CHUNK <= 8192)
        packed = above.to(tl.int32) + tie.to(tl.int32) * 65536
        scan = tl.cumsum(packed, axis=0)
        tie_rank = ties_seen + (scan >> 16)                             # 1-based among the row's ties
        keep = above | (tie & (tie_rank <= need))
        pos = above_seen + (scan & 0xFFFF) + tl.minimum(tie_rank, need) - 1
        out = row * k + pos
        tl.store(val_ptr + out, x, mask=keep)
        tl.store(idx_ptr + out, c.to(idx_ptr.dtype.element_ty), mask=keep)
        total = tl.sum(packed, axis=0)
        above_seen += total & 0xFFFF
        ties_seen += total >> 16


def topk_prune(x: torch.Tensor, k: int, by_magnitude: bool):
    op_topk_prune(x, k, by_magnitude)  # the op's contract: k in [0, row length]
    row_len = x.shape[-1]
    lead = tuple(x.shape[:-1])
    index_dtype = topk_index_dtype(row_len)
    if row_len == 0 or k == 0:  # nothing kept per row (the reference keeps min(k, row) entries)
        return x.new_empty(lead + (0,)), torch.empty(lead + (0,), dtype=index_dtype, device=x.device)
    values = torch.empty(lead + (k,), dtype=x.dtype, device=x.device)
    indices = torch.empty(lead + (k,), dtype=index_dtype, device=x.device)
    n_rows = x.numel() // row_len
    if n_rows == 0:
        return values, indices
    x = x.contiguous()
    cfg = tile_config(row_len, n_rows)
    with on_device(x):
        _topk_kernel[cfg.grid(n_rows)](
            x, values, indices, row_len, k,
            **cfg.constexprs(by_magnitude), num_warps=cfg.num_warps, enable_fp_fusion=False,
        )
    return values, indices


@triton.jit
def _row_of(offs, length):
    """offs // length for 0 <= offs < 2**20 and length >= 1, without an integer division.
    (offs + 0.5) / length is at least 0.5 / length away from an integer; the fp32 product with
    the reciprocal is off by a relative 2**-21 at most (reciprocal within 2 ulp, product
    rounded), i.e. by less than (offs + 0.5) * 2**-21 / length < 0.5 / length: truncation gives
    the exact quotient (on the GPU and in the interpreter alike)."""
    inv = 1.0 / length  # (length may be the constexpr 1: Triton specializes arguments equal to 1)
    return ((offs.to(tl.float32) + 0.5) * inv).to(tl.int32)


# ------------------------------------------------------------------------------ restore
RESTORE_BLOCK = 4096      # output elements per program (several short rows, or a chunk of a long one)


class RestoreConfig:
    """Block shape of `_topk_restore_kernel` (shared with bench/kernels_static.py): `rows` rows
    per program; zeros in `z_chunks` chunks of `zblock`, kept values in `v_chunks` of `vblock`."""

    def __init__(self, row_len: int, k: int, n_rows: int):
        span = max(row_len, k, 1)
        if span <= RESTORE_BLOCK:  # (not fewer rows for a small tensor: one compiled variant per shape of row)
            self.rows = RESTORE_BLOCK // span
            self.zblock = max(16, triton.next_power_of_2(self.rows * max(row_len, 1)))
            self.vblock = max(16, triton.next_power_of_2(self.rows * k))
            self.z_chunks = self.v_chunks = 1
        else:
            self.rows = 1
            self.zblock = RESTORE_BLOCK
            self.vblock = min(RESTORE_BLOCK, triton.next_power_of_2(k))
            self.z_chunks = triton.cdiv(row_len, self.zblock)
            self.v_chunks = triton.cdiv(k, self.vblock)
        self.num_warps = _warps(max(self.zblock, self.vblock) // 4)  # 32 zeros per thread
        self.loop_trips = [n for n in (self.z_chunks, self.v_chunks) if n > 1]

    def constexprs(self) -> dict:
        return {"ROWS": self.rows, "ZBLOCK": self.zblock, "Z_CHUNKS": self.z_chunks,
                "VBLOCK": self.vblock, "V_CHUNKS": self.v_chunks}

    def elements(self, row_len: int) -> int:
        return self.rows * row_len

    def grid(self, n_rows: int) -> tuple[int]:
        return (triton.cdiv(n_rows, self.rows),)


def restore_config(row_len: int, k: int, n_rows: int) -> RestoreConfig:
    return RestoreConfig(row_len, k, n_rows)


def restore_signature(v_type: str, idx_type: str) -> dict:
    return {"val_ptr": v_type, "idx_ptr": idx_type, "out_ptr": v_type, "n_rows": "i32", "row_len": "i32",
            "k": "i32", "ROWS": "constexpr", "ZBLOCK": "constexpr", "Z_CHUNKS": "constexpr",
            "VBLOCK": "constexpr", "V_CHUNKS": "constexpr"}


@triton.jit
def _topk_restore_kernel(
    val_ptr, idx_ptr, out_ptr,
    n_rows, row_len, k,
    ROWS: tl.constexpr, ZBLOCK: tl.constexpr, Z_CHUNKS: tl.constexpr,
    VBLOCK: tl.constexpr, V_CHUNKS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row0 = pid * ROWS
    rows_here = tl.minimum(n_rows - row0, ROWS).to(tl.int32)
    out_rows = out_ptr + row0 * row_len
    # 1. zeros over this program's whole rows (consecutive in memory)
    zoffs = tl.arange(0, ZBLOCK)
    n_out = rows_here * row_len
    zero = tl.zeros([ZBLOCK], dtype=out_ptr.dtype.element_ty)
    for zc in range(Z_CHUNKS):
        o = zc * ZBLOCK + zoffs
        tl.store(out_rows + o, zero, mask=o < n_out)
    # 2. the kept values over them: the barrier orders the zeros before the values (a value
    # may land where another thread of this program wrote a zero).
    tl.debug_barrier()
    voffs = tl.arange(0, VBLOCK)
    n_val = rows_here * k
    for vc in range(V_CHUNKS):
        j = vc * VBLOCK + voffs
        inside = j < n_val
        v = tl.load(val_ptr + row0 * k + j, mask=inside, other=0)
        col = tl.load(idx_ptr + row0 * k + j, mask=inside, other=0).to(tl.int64)
        if ROWS == 1:
            row = tl.zeros([VBLOCK], dtype=tl.int32)
        else:
            row = _row_of(j, k)
        # Indices outside [0, row_len) are dropped instead of writing out of bounds.
        ok = inside & (col >= 0) & (col < row_len)
        tl.store(out_rows + row.to(tl.int64) * row_len + col, v, mask=ok)


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
    shape = values.shape[:-1] + (row_length,)
    if n == 0:  # nothing kept (k = 0 or no rows): all zeros, no kernel
        return values.new_zeros(shape)
    out = values.new_empty(shape)
    k = values.shape[-1]
    n_rows = n // k
    values = values.contiguous()
    indices = indices.contiguous()
    cfg = restore_config(row_length, k, n_rows)
    with on_device(out):
        _topk_restore_kernel[cfg.grid(n_rows)](
            values, indices, out,
            n_rows, row_length, k,
            **cfg.constexprs(), num_warps=cfg.num_warps, enable_fp_fusion=False,
        )
    return out
