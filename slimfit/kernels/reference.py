"""Pure-PyTorch reference of every slimfit op: the specification the C++ and Triton
kernels must match bit for bit (same formulas, same fp32 operation order).

Formats
-------
quantize: the tensor is flattened (row-major) and cut into groups of `group_size`
consecutive elements; the last group may be short. Per group, in fp32:
    mn = min, mx = max
    h = 0.5 if mx - mn overflows to +inf while mn and mx are finite ("wide" group) else 1
    scaled = (mx*h - mn*h) / (2**bits - 1)                   # h = 1: (mx - mn) / (2**bits - 1)
    scale = scaled * 2 if wide else scaled
    inv = 1 / (scaled if scaled >= 2**-126 else 1)           # one IEEE reciprocal per group
    q = (x*h - mn*h) * inv                                   # a multiply per element, no division
    code = clamp(floor(q + 0.5), 0, 2**bits - 1)             # nearest
    code = clamp(floor(q + u), 0, 2**bits - 1)               # stochastic, u = rng.uniform(seed, i)
(every step rounded on its own: no fused multiply-add). h is a power of two, so a wide group
(e.g. one holding +3e38 and -3e38: its range exceeds the largest fp32) is computed exactly as
with an unbounded exponent (x*0.5 is exact but for a subnormal x, which vanishes next to mn*h:
|mn| >= 2**103 in a wide group), and its scale is finite for every finite input. For every other
group h = 1 changes nothing: the formulas are (mx - mn) / L and (x - mn) * inv.
A scale below the smallest normal fp32 (2**-126: a group range under ~3e-36) is treated as a
constant group (all codes 0, dequantized to mn, error <= that range): its reciprocal would
overflow, and subnormal arithmetic differs between backends that flush it.
Codes are packed little-endian inside each byte: element i sits in byte i // (8 // bits)
at bit (i % (8 // bits)) * bits; unused high bits of the last byte are zero.
scale and offset (= mn) are fp32, one per group. A group holding NaN/Inf yields a
non-finite scale or offset (the Python wrapper turns that into an error).
dequantize: y = code * scale + offset in fp32 (no fused multiply-add), cast to dtype. Where that
overflows to +-inf while scale and offset are finite (a wide group's upper codes: code * scale
exceeds fp32 although the result does not), y = clamp((code * (scale/4) + offset/4) * 4,
-FLT_MAX, FLT_MAX): the same value computed a quarter down (exact scalings), saturated at the
largest fp32 (a reconstruction can exceed an input near FLT_MAX by a few ulps). Finite scale
and offset never give a non-finite value; every value that does not overflow is unchanged.

quantize_blockwise (block-wise dynamic quantization, the codec of optimizer moments): the tensor is
flattened (row-major) and cut into blocks of `block_size` consecutive elements; the last may be short.
qmap is a strictly increasing fp32 map of 16 or 256 levels (4- or 8-bit codes; slimfit/kernels/qmaps.py).
In fp32, every step rounded on its own:
    absmax = max |x| over the block                          (NaN if the block holds one; +inf for an inf)
    inv = 1 / absmax if absmax >= 2**-126 else 0             (one IEEE reciprocal per block; a zero or
                                                              subnormal block, and a non-finite one, get 0)
    y = x * inv
    mid[i] = (qmap[i] + qmap[i + 1]) * 0.5                   (the midpoints, i = 0 .. levels - 2)
    code = #{i : mid[i] < y}                                 (stochastic=False: the nearest level; a y exactly
                                                              on a midpoint takes the lower level; NaN y -> 0)
stochastic=True rounds y to one of the two levels around it, the upper one with probability
(y - lower) / (upper - lower), drawing u = rng.uniform(seed, i) at the flat element index i (the linear
quantize's counter layout, so one seed gives the same u per element in both codes):
    g[k] = 1 / (qmap[k + 1] - qmap[k]), k < levels - 1;  g[levels - 1] = 0      (the inverse gaps, IEEE)
    c = #{k >= 1 : qmap[k] <= y}                             (the level at or below y; 0 below qmap[0] and
                                                              for NaN y; levels - 1 at or above the top)
    t = (y - qmap[c]) * g[c]                                 (y's place in [qmap[c], qmap[c + 1]): in [0, 1]
                                                              up to rounding; < 0 below qmap[0]; 0 at the top)
    code = c + 1 if u < t else c
P(code = c + 1) = ceil(t * 2**24) / 2**24, within 2**-24 of t: E[qmap[code]] = y up to 2**-24 of the gap and
the fp32 rounding of t. A y on a level keeps it (t = 0), a y below the smallest level takes it (t < 0: the
unsigned map's zero-free bottom), a y at the top keeps the top (g = 0), NaN y takes code 0 (t is NaN).
Codes are packed as quantize packs them (4-bit: element i in byte i // 2 at bit 4 * (i % 2)); absmax is
fp32, one per block. A block holding NaN/Inf has a non-finite absmax (the Python wrapper turns that into
an error with check_finite=True) and dequantizes to non-finite values; a block of zeros or of subnormals
(absmax < 2**-126) gets every code of y = 0, restored as qmap[code] * absmax: 0, or a value below 2**-126.
Bit-exact across backends for maps whose midpoints, levels and gaps are normal fp32 numbers or 0 (qmaps.py's
are), since a GPU may flush a subnormal y to 0: the comparisons come out alike, and stochastic rounding's
t = y * g of a subnormal y above the 0 level is below 2**-100, so only a draw of u = 0 exactly (a chance of
2**-24 per such element) could tell the flushed y from the unflushed one.
dequantize_blockwise: y = qmap[code] * absmax in fp32 (one multiply), cast to dtype. |qmap| <= 1 keeps
it within the block's absmax: no overflow.

topk_prune: per row of the last dimension, keep the k entries with the largest key
(key = x, or |x| when by_magnitude). Ties at the threshold keep the lowest indices.
Kept entries are listed in ascending index order; values keep the input dtype, indices
are int16 when the row length is at most 32768, int32 otherwise.
topk_restore: each row's indices strictly ascending (as topk_prune lists them) and inside
[0, row_length); the op checks refuse anything else (a repeated index would make the write order,
which differs between backends, decide the result).

pack_bits: element i of the flattened mask is bit i % 8 of byte i // 8.

dropout_mask: keep element i when rng.uniform(seed, i) >= p.
seeded_dropout: y = x * float32(1 / (1 - p)) where kept (in fp32, cast back), else 0;
p == 1 gives zeros.

round_stochastic (an fp32 tensor to bfloat16 or float16, unbiased: E[y] = x for every finite x whose nearest
rounding is finite), element i drawing from rng.random_words(seed, i):
    bfloat16: b = the bits of x (int32), t = b & 0xFFFF0000 (x truncated toward zero), w = word & 0xFFFF;
              y = the bf16 whose fp32 bits are t + 0x10000 if w < (b & 0xFFFF) else t
              (one bf16 ulp away from zero with probability (low 16 bits of x) / 2**16)
    float16:  n = x rounded to nearest (fp16), o = nextafter(n, +inf if n < x else -inf), lo = min(n, o),
              hi = max(n, o) (in fp32); p = (x - lo) / (hi - lo) (fp32); y = hi if u < p else lo,
              u = rng.uniform(seed, i)
    either:   y = x rounded to nearest where x is not finite or that rounding is not (NaN, +-inf kept;
              a value past the format's largest stays with round-to-nearest's infinity)
y has x's shape (contiguous).
"""
from __future__ import annotations

import torch

from . import rng
from .validation import codes_per_byte, num_groups, topk_index_dtype

_MIN_NORMAL = 2.0**-126  # smallest normal fp32: a smaller scale is a constant group
_FP32_MAX = torch.finfo(torch.float32).max


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: int64 (n,) with values < 2**bits -> uint8 (ceil(n / per),)."""
    per = codes_per_byte(bits)
    n = codes.numel()
    pad = (-n) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    shifts = torch.arange(per, device=codes.device, dtype=torch.int64) * bits
    return (codes.view(-1, per) << shifts).sum(dim=1).to(torch.uint8)


def _unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    per = codes_per_byte(bits)
    shifts = torch.arange(per, device=packed.device, dtype=torch.int64) * bits
    codes = (packed.to(torch.int64).unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:numel]


def quantize(x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int):
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    ng = num_groups(n, group_size)
    if n == 0:
        empty = torch.empty(0, dtype=torch.float32, device=x.device)
        return torch.empty(0, dtype=torch.uint8, device=x.device), empty, empty.clone()
    pad = ng * group_size - n
    # Edge padding keeps each group's min and max unchanged.
    padded = torch.cat([flat, flat[-1:].expand(pad)]) if pad else flat
    groups = padded.view(ng, group_size)
    mn = groups.amin(dim=1)
    mx = groups.amax(dim=1)
    levels = (1 << bits) - 1
    # A wide group (finite, but mx - mn overflows fp32) is computed at half scale, exactly.
    wide = torch.isinf(mx - mn) & torch.isfinite(mx) & torch.isfinite(mn)
    h = torch.where(wide, 0.5, 1.0)
    scaled = (mx * h - mn * h) / levels  # scale * h
    scale = torch.where(wide, scaled * 2.0, scaled)
    divisor = torch.where(scaled >= _MIN_NORMAL, scaled, torch.ones_like(scaled))
    inv = 1.0 / divisor
    q = (groups * h[:, None] - (mn * h)[:, None]) * inv[:, None]
    if stochastic:
        noise = rng.uniform(seed, ng * group_size, x.device).view(ng, group_size)
    else:
        noise = 0.5
    codes = torch.floor(q + noise).clamp_(0, levels).to(torch.int64).reshape(-1)[:n]
    return _pack_codes(codes, bits), scale, mn


def dequantize(codes, scale, offset, bits: int, group_size: int, shape, dtype):
    n = 1
    for s in shape:
        n *= int(s)
    if n == 0:
        return torch.empty(tuple(shape), dtype=dtype, device=codes.device)
    # Any layout of the parts (a 0-d scale of one group, 2-d codes): their elements in order.
    codes, scale, offset = codes.reshape(-1), scale.reshape(-1), offset.reshape(-1)
    values = _unpack_codes(codes, bits, n).to(torch.float32)
    group = torch.arange(n, device=codes.device) // group_size
    s, o = scale[group], offset[group]
    out = values * s
    out = out + o
    # Overflow with finite scale and offset: the same value a quarter down, saturated (docstring).
    redo = torch.isinf(out) & torch.isfinite(s) & torch.isfinite(o)
    quarter = (values * (s * 0.25) + o * 0.25) * 4.0
    out = torch.where(redo, quarter.clamp(-_FP32_MAX, _FP32_MAX), out)
    return out.to(dtype).view(tuple(shape))


def _midpoints(qmap: torch.Tensor) -> torch.Tensor:
    """mid[i] = (qmap[i] + qmap[i + 1]) * 0.5 in fp32: the boundaries between neighbouring levels."""
    q = qmap.reshape(-1)
    return (q[:-1] + q[1:]) * 0.5


def _inverse_gaps(q: torch.Tensor) -> torch.Tensor:
    """g[k] = 1 / (q[k + 1] - q[k]) in fp32 (two IEEE operations), and g[levels - 1] = 0: stochastic rounding's
    table, so that y's place between two levels is a subtraction and a multiply."""
    return torch.cat([1.0 / (q[1:] - q[:-1]), q.new_zeros(1)])


def _stochastic_codes(y: torch.Tensor, q: torch.Tensor, seed: int, start: int = 0) -> torch.Tensor:
    """The level at or below y, or the one above it with probability y's place between them (docstring);
    element i draws the uniform of index start + i."""
    c = torch.searchsorted(q[1:].contiguous(), y, right=True)            # #{k >= 1 : q[k] <= y}
    c = torch.where(torch.isnan(y), 0, c)
    t = (y - q[c]) * _inverse_gaps(q)[c]
    u = rng.uniform(seed, y.numel(), y.device, start)
    return c + (u < t).to(torch.int64)


def quantize_blockwise(x: torch.Tensor, qmap: torch.Tensor, block_size: int, stochastic: bool = False,
                       seed: int = 0):
    return quantize_blockwise_from(x, qmap, block_size, stochastic, seed, 0)


def quantize_blockwise_from(x: torch.Tensor, qmap: torch.Tensor, block_size: int, stochastic: bool, seed: int,
                            start: int):
    """quantize_blockwise with element i drawing index start + i (a piece of a larger tensor)."""
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    nb = num_groups(n, block_size)
    bits = 4 if qmap.numel() == 16 else 8
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device), torch.empty(0, dtype=torch.float32, device=x.device)
    pad = nb * block_size - n
    padded = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat   # zeros change no block's absmax
    blocks = padded.view(nb, block_size)
    absmax = blocks.abs().amax(dim=1)
    inv = torch.where(absmax >= _MIN_NORMAL, 1.0 / absmax, torch.zeros_like(absmax))
    y = (blocks * inv[:, None]).reshape(-1)[:n]
    q = qmap.reshape(-1).to(torch.float32)
    if stochastic:
        return _pack_codes(_stochastic_codes(y, q, seed, start), bits), absmax
    codes = torch.searchsorted(_midpoints(q), y)   # #{mid < y}: side="left"
    codes = torch.where(torch.isnan(y), 0, codes)
    return _pack_codes(codes, bits), absmax


def dequantize_blockwise(codes, absmax, qmap, block_size: int, shape, dtype):
    n = 1
    for s in shape:
        n *= int(s)
    if n == 0:
        return torch.empty(tuple(shape), dtype=dtype, device=codes.device)
    q = qmap.reshape(-1).to(torch.float32)
    bits = 4 if q.numel() == 16 else 8
    values = q[_unpack_codes(codes.reshape(-1), bits, n)]
    block = torch.arange(n, device=codes.device) // block_size
    return (values * absmax.reshape(-1)[block]).to(dtype).view(tuple(shape))


def topk_prune(x: torch.Tensor, k: int, by_magnitude: bool):
    key = x.abs() if by_magnitude else x
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k]
    idx = torch.sort(order, dim=-1).values
    values = torch.gather(x, -1, idx)
    return values, idx.to(topk_index_dtype(x.shape[-1]))


def topk_restore(values: torch.Tensor, indices: torch.Tensor, row_length: int):
    out = values.new_zeros(values.shape[:-1] + (row_length,))
    if values.numel() == 0:
        return out
    # int16 indices may encode rows up to 32768 only; int32 beyond.
    idx = indices.to(torch.int64)
    return out.scatter_(-1, idx, values)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    bits = mask.reshape(-1).to(torch.int64)
    n = bits.numel()
    pad = (-n) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    shifts = torch.arange(8, device=mask.device, dtype=torch.int64)
    return (bits.view(-1, 8) << shifts).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64)
    # The bytes in order, whatever packed's shape (0-d, 2-d, a view), as the other backends read them.
    bits = (packed.reshape(-1).to(torch.int64).unsqueeze(1) >> shifts) & 1
    return bits.reshape(-1)[:numel].to(torch.bool)


def dropout_mask(like: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    u = rng.uniform(seed, like.numel(), like.device)
    return (u >= p).view(like.shape)


def apply_keep(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """Inverted dropout with a given mask, THE formula of every dropout in slimfit: x · float32(1/(1-p))
    in fp32 where kept, 0 elsewhere, cast back to x's dtype (all zeros for p = 1). Python scalars,
    not tensors: the same fp32 arithmetic, no scalar tensors created."""
    if p >= 1.0:
        return torch.zeros_like(x, memory_format=torch.contiguous_format)
    y = torch.where(keep, x.to(torch.float32) * (1.0 / (1.0 - p)), 0.0)
    # no no-op .to for fp32: under torch 2.11's dynamo, an autograd.Function returning it routes its
    # gradient to the wrong output (zeros; pytorch/pytorch#180642, fixed in 2.12)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def seeded_dropout(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    if p >= 1.0:
        return torch.zeros_like(x, memory_format=torch.contiguous_format)
    return apply_keep(x, dropout_mask(x, p, seed), p)


_LOW16 = 0xFFFF
_TRUNC16 = -0x10000   # int32 mask of the high 16 bits (0xFFFF0000)


def _round_bf16(x: torch.Tensor, seed: int, start: int = 0) -> torch.Tensor:
    bits = x.reshape(-1).view(torch.int32)
    draw = (rng.random_words(seed, bits.numel(), x.device, start) & _LOW16).to(torch.int32)
    trunc = bits & _TRUNC16
    up = torch.where(draw < (bits & _LOW16), trunc + 0x10000, trunc)
    return up.view(torch.float32).to(torch.bfloat16).view(x.shape)   # low 16 bits zero: the cast is exact


def _round_fp16(x: torch.Tensor, seed: int, start: int = 0) -> torch.Tensor:
    near = x.to(torch.float16)
    nf = near.float()
    toward = torch.where(nf < x, torch.inf, -torch.inf).to(torch.float16)
    other = torch.nextafter(near, toward).float()
    lo, hi = torch.minimum(nf, other), torch.maximum(nf, other)
    p_up = (x - lo) / (hi - lo)
    u = rng.uniform(seed, x.numel(), x.device, start).view(x.shape)
    return torch.where(u < p_up, hi, lo).to(torch.float16)


def round_stochastic(x: torch.Tensor, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return round_stochastic_from(x, dtype, seed, 0)


def round_stochastic_from(x: torch.Tensor, dtype: torch.dtype, seed: int, start: int) -> torch.Tensor:
    """round_stochastic with element i drawing index start + i (a piece of a larger tensor)."""
    x = x.contiguous()
    near = x.to(dtype)
    out = (_round_bf16 if dtype == torch.bfloat16 else _round_fp16)(x, seed, start)
    return torch.where(torch.isfinite(near) & torch.isfinite(x), out, near)


from .reference_adam import adam_blockwise_  # noqa: E402,F401  (the fused held Adam step; its own file)
