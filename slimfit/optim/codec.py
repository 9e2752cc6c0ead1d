"""Codec for one optimizer moment held compressed, on slimfit's own kernels: two codes.

code="linear" (8 bits; the default, and every entry written before the dynamic code existed) is below.
code="dynamic" (8 or 4 bits) is block-wise dynamic quantization, the codec of bitsandbytes' and torchao's
8-bit Adam: a signed dynamic map for a first moment, sqrt(v) coded with an unsigned map without zero for a
second one, rounded stochastically from the same seeds as the linear code (``stochastic=False``: to the
nearest level); its format, bounds and the measurement that chose sqrt(v) are in dynamic_code.py. An entry
records its code (``"dynamic": True`` and ``"bits"``; an entry without the key is linear, so older
checkpoints load) and its rounding (``"stochastic"``; a dynamic entry without it was rounded to nearest and
its pieces stay so), and every function here takes either.

The linear code: ``encode`` quantizes with ``slimfit.kernels.quantize`` (8 bits, per-group min/max over `group_size`
consecutive elements of the flattened tensor, fp32 scale and offset per group, stochastic rounding from a
seed); ``decode`` restores with ``slimfit.kernels.dequantize``. Two transforms:

linear (AdamW's ``exp_avg``, SGD's ``momentum_buffer``): x itself is quantized. With Δ the group's step
    (max - min) / 255 (the stored scale), the restored x̂ has |x̂ - x| <= Δ (stochastic rounding picks
    one of the two neighbouring levels; unbiased, E[x̂] = x), plus fp32 rounding of a few ulps of the
    group's largest magnitude.

sqrt (``exp_avg_sq``, ``max_exp_avg_sq``, ...): a second moment v spans dozens of decades in one layer,
    and a v restored as 0 where it was not makes AdamW's next update m / (sqrt(v) + eps) explode. So
    s = sqrt(v) is quantized (half the decades), and the restore is ŝ = max(dequantize, L) with
    L = Δ (stochastic rounding) or Δ / 2 (round to nearest), the most that rounding could have lost;
    v̂ = ŝ². For a group with Δ_s > 0 (Δ_s the step of s):
        ŝ >= L > 0                   never below what rounding could have lost: no 0 is made
        |ŝ - s| <= Δ_s               (the floor moves a value by at most Δ_s: s < 2 L there)
        ŝ >= s / 2                   so v̂ >= v / 4: with the same m, the first update after the restore
                                     is at most twice the exact one, elementwise
    A constant group (Δ_s = 0: all-zero rows of a layer that had no gradient there) restores s exactly.
    These bounds hold in fp32 up to a few ulps of the group's largest s (tested); a bf16 or fp16 moment
    adds its own rounding when cast back.

Bytes: numel (codes) + 8 * ceil(numel / group_size) (scale, offset) against 4 * numel in fp32: 3.76x
smaller at group 128.

Either entry is a plain dict of tensors, bools, ints, a tuple of ints and a dtype (no strings:
``Optimizer.load_state_dict`` rebuilds every iterable it meets), so it can sit in ``optimizer.state``.
"""
from __future__ import annotations

import math

import torch

from slimfit.kernels import QuantizedTensor, dequantize, quantize

from . import dynamic_code

__all__ = ["encode", "decode", "encoded_nbytes", "entry_nbytes", "code_of", "is_encoded", "rounding_loss",
           "zeros_entry", "decode_range", "encode_range_", "decode_ranges", "encode_ranges_", "CODES", "check_code"]

BITS = 8
CODES = ("linear", "dynamic")
_KEYS = ("codes", "scale", "offset")


def check_code(code: str, bits: int, group_size: int) -> None:
    """ValueError unless (code, bits, group_size) is a format this codec writes."""
    if code not in CODES:
        raise ValueError(f"codec: code must be one of {CODES}, got {code!r}")
    if code == "linear" and bits != BITS:
        raise ValueError(f"codec: the linear code is 8-bit only, got bits={bits!r}; 4-bit moments need "
                         "code='dynamic'")
    if code == "dynamic":
        dynamic_code.check(group_size, bits)


def encoded_nbytes(numel: int, group_size: int = 128, code: str = "linear", bits: int = 8) -> int:
    """Bytes of one encoded moment of ``numel`` elements: linear, 8-bit codes plus fp32 scale and offset per
    group; dynamic, ``bits``-bit codes plus one fp32 absmax per block."""
    if code == "dynamic":
        return dynamic_code.nbytes(numel, group_size, bits)
    return numel + 8 * (-(-numel // group_size))


def _dynamic(entry: dict) -> bool:
    return bool(entry.get("dynamic", False))


def code_of(entry: dict) -> dict:
    """The entry's code as encode's keywords: {"code": "linear" | "dynamic", "bits": 8 | 4}."""
    return {"code": "dynamic", "bits": int(entry["bits"])} if _dynamic(entry) else {"code": "linear", "bits": BITS}


def entry_nbytes(entry: dict) -> int:
    """Bytes the entry's tensors hold (codes, and scales and offsets or block maxima)."""
    keys = ("codes", "absmax") if _dynamic(entry) else _KEYS
    return sum(entry[k].numel() * entry[k].element_size() for k in keys)


def is_encoded(value) -> bool:
    if not isinstance(value, dict) or "codes" not in value or "sqrt" not in value:
        return False
    return "absmax" in value if _dynamic(value) else all(k in value for k in _KEYS)


def rounding_loss(scale: torch.Tensor, stochastic: bool) -> torch.Tensor:
    """Per group, the most that rounding could have lost: the step (stochastic) or half of it (nearest)."""
    return scale if stochastic else scale * 0.5


@torch.no_grad()
def encode(t: torch.Tensor, *, sqrt: bool, seed: int, group_size: int = 128, stochastic: bool = True,
           code: str = "linear", bits: int = 8) -> dict:
    """The entry of moment ``t`` (``sqrt``: a second moment); ``t`` itself is untouched and can be dropped by
    the caller. Temporaries: one fp32 copy of ``t`` for the square root. Either code rounds stochastically
    from ``seed`` (unbiased), or to the nearest level with ``stochastic=False``; the entry records which."""
    check_code(code, bits, group_size)
    if code == "dynamic":
        return dynamic_code.encode(t, bool(sqrt), int(group_size), int(bits), bool(stochastic), int(seed))
    q = _quantized(t, sqrt, group_size, stochastic, seed)
    return {"codes": q.codes, "scale": q.scale, "offset": q.offset, "shape": tuple(int(s) for s in t.shape),
            "dtype": t.dtype, "group_size": int(group_size), "sqrt": bool(sqrt), "stochastic": bool(stochastic)}


def _quantized(t: torch.Tensor, sqrt: bool, group_size: int, stochastic: bool, seed: int) -> QuantizedTensor:
    """``t`` (or its square root) quantized to 8-bit codes with per-group scale and offset."""
    x = t.detach()
    if sqrt:
        x = x.float().clamp_min(0).sqrt_()   # v >= 0 by construction; clamp keeps a stray -0.0 or -tiny out of NaN
    return quantize(x, bits=BITS, group_size=group_size, stochastic=stochastic, seed=seed)


def _floor_per_group_(flat: torch.Tensor, floors: torch.Tensor, group_size: int) -> None:
    """flat[i] = max(flat[i], floors[i // group_size]), in place."""
    n = flat.numel()
    full = n // group_size
    if full:
        flat[: full * group_size].view(full, group_size).clamp_min_(floors[:full, None])
    if n > full * group_size:
        flat[full * group_size:].clamp_min_(floors[full])


@torch.no_grad()
def decode(entry: dict, device: torch.device | None = None) -> torch.Tensor:
    """The moment restored from ``encode``'s entry, in its original dtype and shape (on ``device``, by
    default the codes' device). Codes or scales cast by a plain ``Optimizer.load_state_dict`` (uint8 to the
    parameter's float dtype) are read back losslessly as long as the scales stayed fp32."""
    codes = entry["codes"]
    device = codes.device if device is None else torch.device(device)
    if _dynamic(entry):
        return dynamic_code.restore(entry, codes, entry["absmax"], tuple(entry["shape"]), device)
    return _restored(entry, codes, entry["scale"], entry["offset"], tuple(entry["shape"]), device)


def _restored(entry: dict, codes, scale, offset, shape: tuple, device) -> torch.Tensor:
    """Codes with their groups' scales and offsets restored to the entry's moment (its floor and square for
    a second moment), in the entry's dtype."""
    x = _floored(entry, codes, scale, offset, shape, device)
    if entry["sqrt"]:
        x.square_()
    return x.to(entry["dtype"])


def _floored(entry: dict, codes, scale, offset, shape: tuple, device) -> torch.Tensor:
    """The dequantized fp32 values of the codes (for a second moment: s = sqrt(v) with its floor, not yet
    squared)."""
    codes = codes.to(device=device, dtype=torch.uint8)
    scale = scale.to(device=device, dtype=torch.float32)
    offset = offset.to(device=device, dtype=torch.float32)
    group_size = int(entry["group_size"])
    x = dequantize(QuantizedTensor(codes, scale, offset, shape, torch.float32, BITS, group_size))
    if entry["sqrt"]:
        _floor_per_group_(x.view(-1), rounding_loss(scale, bool(entry["stochastic"])), group_size)
    return x


# ---------------------------------------------------------------- a range of elements at a time
# A moment held 8-bit at every step (FrozenState(between_steps=True) under slimfit.optim.ChunkedStep) is
# decoded, updated and encoded one piece of the flattened tensor at a time, never in full. A piece starts at
# a multiple of the group size, so its groups are the entry's own: the entry stays what encode would give
# for the whole tensor, piece by piece (each piece with its own rounding seed).

def zeros_entry(shape, dtype: torch.dtype, device, *, sqrt: bool, group_size: int = 128,
                stochastic: bool = True, code: str = "linear", bits: int = 8) -> dict:
    """The entry of an all-zero moment (what an optimizer's fresh state holds), made without the moment:
    codes, scales and offsets all zero decode to exactly 0 (a second moment's floor is then 0 too); a dynamic
    entry is what encode gives zeros (dynamic_code.zeros), which decodes to exactly 0 too."""
    check_code(code, bits, group_size)
    if code == "dynamic":
        return dynamic_code.zeros(shape, dtype, device, bool(sqrt), int(group_size), int(bits), bool(stochastic))
    numel = math.prod(int(s) for s in shape)
    groups = -(-numel // group_size)
    # scales and offsets halves of one zero fill (two launches on a GPU for the entry, not three): they live
    # and die together, as the entry's tensors do (torch.save keeps views of one dtype of a storage together)
    scale_offset = torch.zeros(2, groups, dtype=torch.float32, device=device)
    return {"codes": torch.zeros(numel, dtype=torch.uint8, device=device),
            "scale": scale_offset[0], "offset": scale_offset[1],
            "shape": tuple(int(s) for s in shape), "dtype": dtype, "group_size": int(group_size),
            "sqrt": bool(sqrt), "stochastic": bool(stochastic)}


def _group_range(entry: dict, start: int, end: int) -> tuple[int, int]:
    g = int(entry["group_size"])
    if start % g:
        raise ValueError(f"codec: a range must start at a multiple of the group size {g}, got {start}")
    return start // g, -(-end // g)


@torch.no_grad()
def decode_range(entry: dict, start: int, end: int) -> torch.Tensor:
    """Elements [start, end) of the flattened moment, restored as ``decode`` restores them (fp32 while the
    moment is fp32, the original dtype otherwise); start a multiple of the group size."""
    a, b = _group_range(entry, start, end)
    if _dynamic(entry):
        codes = entry["codes"].view(-1)[dynamic_code.code_slice(entry, start, end)]
        return dynamic_code.restore(entry, codes, entry["absmax"][a:b], (end - start,), codes.device)
    codes = entry["codes"].view(-1)[start:end]
    return _restored(entry, codes, entry["scale"][a:b], entry["offset"][a:b], (end - start,), codes.device)


@torch.no_grad()
def encode_range_(entry: dict, start: int, x: torch.Tensor, *, seed: int) -> None:
    """Encode ``x`` (flat) into elements [start, start + x.numel()) of the entry, in place; start a multiple
    of the group size, and the range the whole last group it touches (or the tensor's end)."""
    x = x.detach()
    if entry["sqrt"] and not _dynamic(entry):   # the linear code quantizes sqrt(v) (_quantized's root)
        x = x.float().clamp_min(0).sqrt_()
    _encode_alone(entry, start, x, seed, lambda dst, src: dst.copy_(src))


# ---------------------------------------------------------------- many ranges at a time
# The held step (held_step.py) decodes and encodes the pieces of several parameters together: what is
# elementwise and the same for every piece (a second moment's square, its square root, the copies of the new
# codes into the entries) runs as one multi-tensor op over all of them, so that a GPU launches it once
# instead of once per piece. Each piece's values are those of decode_range / encode_range_ bit for bit.

# At least this many ranges of alike linear entries are decoded by one dequantize over their concatenated
# codes (three concatenations and one kernel, instead of one kernel per range).
CONCAT_DECODE_MIN = 2


def _concat_key(entry: dict, start: int, end: int):
    """What ranges decoded together must share (None: decoded alone): a linear entry, or an 8-bit dynamic one,
    whose codes and scales (maxima) are as encode wrote them."""
    if _dynamic(entry):
        codes, absmax = entry["codes"], entry["absmax"]
        if int(entry["bits"]) != 8 or codes.dtype != torch.uint8 or absmax.dtype != torch.float32:
            return None
        return "dynamic", int(entry["group_size"]), bool(entry["sqrt"]), codes.device
    codes, scale, offset = entry["codes"], entry["scale"], entry["offset"]
    if codes.dtype != torch.uint8 or scale.dtype != torch.float32 or offset.dtype != torch.float32:
        return None
    return int(entry["group_size"]), bool(entry["sqrt"]), bool(entry["stochastic"]), codes.device


def _decode_together(ranges) -> list:
    """The fp32 values of ranges of alike entries (a linear second moment's floored, not squared; a dynamic
    one's squared) as views of one dequantized buffer: a range whose last group is short (a tensor's end) is
    padded to a whole group with zero codes, so every range's groups are its own; the kernels' arithmetic is
    per element and group, so each range's values are those it gets alone."""
    entry = ranges[0][0]
    gs = int(entry["group_size"])
    sizes = [b - a for _, a, b in ranges]
    pads = [-n % gs for n in sizes]
    zero = entry["codes"].new_zeros(max(pads)) if any(pads) else None
    parts = []
    for (e, a, b), pad in zip(ranges, pads):
        parts += [e["codes"].view(-1)[a:b]] + ([zero[:pad]] if pad else [])
    codes = torch.cat(parts)
    if _dynamic(entry):
        absmax = torch.cat([e["absmax"][a // gs:-(-b // gs)] for e, a, b in ranges])
        x = dynamic_code.restore({**entry, "dtype": torch.float32}, codes, absmax, (codes.numel(),), codes.device)
        return _split(x, sizes, pads)
    scale = torch.cat([e["scale"][a // gs:-(-b // gs)] for e, a, b in ranges])
    offset = torch.cat([e["offset"][a // gs:-(-b // gs)] for e, a, b in ranges])
    x = dequantize(QuantizedTensor(codes, scale, offset, (codes.numel(),), torch.float32, BITS, gs))
    if entry["sqrt"]:
        _floor_per_group_(x, rounding_loss(scale, bool(entry["stochastic"])), gs)
    return _split(x, sizes, pads)


@torch.no_grad()
def decode_ranges(ranges) -> list:
    """``decode_range(entry, start, end)`` of each (entry, start, end) in ``ranges``, the same values; ranges of
    alike entries (linear, or 8-bit dynamic; CONCAT_DECODE_MIN or more) decoded by one kernel, the linear
    second moments' squares taken by one multi-tensor op."""
    ranges = list(ranges)
    out: list = [None] * len(ranges)
    keys = [_concat_key(*r) for r in ranges]
    together: dict = {}
    for j, key in enumerate(keys):
        if key is not None:
            together.setdefault(key, []).append(j)
    for idx in together.values():
        if len(idx) >= CONCAT_DECODE_MIN:
            for j, x in zip(idx, _decode_together([ranges[j] for j in idx])):
                out[j] = x
    squared = []
    for j, (entry, start, end) in enumerate(ranges):
        if out[j] is None and (_dynamic(entry) or not entry["sqrt"]):
            out[j] = decode_range(entry, start, end)
        elif entry["sqrt"] and not _dynamic(entry):
            if out[j] is None:
                a, b = _group_range(entry, start, end)
                codes = entry["codes"].view(-1)[start:end]
                out[j] = _floored(entry, codes, entry["scale"][a:b], entry["offset"][a:b], (end - start,), codes.device)
            squared.append(j)
    if squared:
        xs = [out[j] for j in squared]
        torch._foreach_mul_(xs, xs)   # x * x: square_'s arithmetic
    return [x if x.dtype == entry["dtype"] else x.to(entry["dtype"]) for x, (entry, _, _) in zip(out, ranges)]


# At least this many ranges of alike entries are encoded by one kernel over their concatenation.
CONCAT_ENCODE_MIN = 2


def _encode_key(entry: dict, x: torch.Tensor):
    """What ranges encoded together must share (None: encoded alone): the code and its format, the rounding,
    and the values' device and dtype; a linear entry's tensors as encode wrote them. 4-bit codes are encoded
    alone (two to a byte: a range's last byte would carry a neighbour's code)."""
    if _dynamic(entry):
        if int(entry["bits"]) != 8:
            return None
        return ("dynamic", int(entry["group_size"]), bool(entry["sqrt"]), dynamic_code.rounds_stochastically(entry),
                x.device, x.dtype)
    if _concat_key(entry, 0, 0) is None:
        return None
    return ("linear", int(entry["group_size"]), bool(entry["sqrt"]), bool(entry["stochastic"]), x.device, x.dtype)


def _padded_concat(xs, group_size: int) -> tuple[torch.Tensor, list, list]:
    """The flat ``xs`` one after another, each padded to whole groups by repeating its last value (a group's
    minimum, maximum and absolute maximum stay its own values'), with each range's size and padding."""
    sizes = [x.numel() for x in xs]
    pads = [-n % group_size for n in sizes]
    parts = []
    for x, pad in zip(xs, pads):
        flat = x.reshape(-1)
        parts += [flat] + ([flat[-1:].expand(pad)] if pad else [])
    return torch.cat(parts), sizes, pads


def _split(t: torch.Tensor, sizes, pads, per: int = 1) -> list:
    """The ranges' parts of a concatenation's per-element (``per`` 1) or per-group (``per``: the group size)
    tensor, padding dropped."""
    out, at = [], 0
    for n, pad in zip(sizes, pads):
        out.append(t[at // per: at // per + -(-n // per)])
        at += n + pad
    return out


def _encode_together(items, copy) -> None:
    """Alike ranges (entry, start, x, seed) encoded by one kernel over their padded concatenation, rounded
    from the first range's seed (the first range gets what it gets alone with that seed; the others the
    same stream further on); the new codes, scales and maxima handed to ``copy(dst, src)``."""
    entry, seed = items[0][0], items[0][3]
    gs = int(entry["group_size"])
    x, sizes, pads = _padded_concat([x for _, _, x, _ in items], gs)
    if _dynamic(entry):
        codes, absmax = dynamic_code.quantized(x, bool(entry["sqrt"]), gs, BITS,
                                               dynamic_code.rounds_stochastically(entry), seed)
        per_group = {"absmax": _split(absmax.view(-1), sizes, pads, gs)}
    else:
        q = quantize(x, bits=BITS, group_size=gs, stochastic=bool(entry["stochastic"]), seed=seed)
        codes = q.codes
        per_group = {"scale": _split(q.scale.view(-1), sizes, pads, gs),
                     "offset": _split(q.offset.view(-1), sizes, pads, gs)}
    for j, (codes_j, (e, start, x_j, _)) in enumerate(zip(_split(codes.view(-1), sizes, pads), items)):
        end = start + x_j.numel()
        a, b = _group_range(e, start, end)
        copy(e["codes"].view(-1)[start:end], codes_j)
        for key, parts in per_group.items():
            copy(e[key][a:b], parts[j])


def _encode_alone(entry: dict, start: int, x: torch.Tensor, seed: int, copy) -> None:
    """encode_range_ of one range (a linear second moment's ``x`` already its root), the new codes, scales
    and maxima handed to ``copy(dst, src)``."""
    end = start + x.numel()
    a, b = _group_range(entry, start, end)
    if _dynamic(entry):
        codes, absmax = dynamic_code.quantized(x, bool(entry["sqrt"]), int(entry["group_size"]), int(entry["bits"]),
                                               dynamic_code.rounds_stochastically(entry), seed)
        copy(entry["codes"].view(-1)[dynamic_code.code_slice(entry, start, end)], codes.view(-1))
        copy(entry["absmax"][a:b], absmax.view(-1))
        return
    q = quantize(x, bits=BITS, group_size=int(entry["group_size"]), stochastic=bool(entry["stochastic"]), seed=seed)
    copy(entry["codes"].view(-1)[start:end], q.codes.view(-1))
    copy(entry["scale"][a:b], q.scale.view(-1))
    copy(entry["offset"][a:b], q.offset.view(-1))


@torch.no_grad()
def encode_ranges_(items) -> None:
    """Each (entry, start, x, seed) in ``items`` encoded into elements [start, start + x.numel()) of its entry,
    as a held step's call encodes its pieces: ranges of alike entries (CONCAT_ENCODE_MIN or more; same code,
    format, rounding, device and dtype, 8-bit) by one kernel over their concatenation, each padded to whole
    groups with its last value, rounded stochastically from the first such range's seed (each range's
    groups are its own; a range alone gets exactly what ``encode_range_(entry, start, x, seed=seed)``
    writes); the others one at a time as encode_range_. The linear second moments' square roots are taken by
    multi-tensor ops (in place: an fp32 ``x`` of a second moment is used as scratch), the new codes, scales
    and maxima copied into the entries by one multi-tensor copy per dtype."""
    items = list(items)
    roots = [i for i, (entry, _, _, _) in enumerate(items) if entry["sqrt"] and not _dynamic(entry)]
    xs = {i: items[i][2].detach().float() for i in roots}
    if roots:
        torch._foreach_clamp_min_(list(xs.values()), 0)   # as _quantized: -0.0 or -tiny kept out of NaN
        torch._foreach_sqrt_(list(xs.values()))
    # a linear second moment's root is coded without a further root: its values are the roots now
    items = [(e, a, xs.get(i, x.detach()), seed) for i, (e, a, x, seed) in enumerate(items)]
    copies: dict = {}

    def copy(dst, src):
        copies.setdefault((dst.dtype, src.dtype, dst.device), []).append((dst, src))

    together: dict = {}
    for i, (entry, _, x, _) in enumerate(items):
        key = _encode_key(entry, x)
        together.setdefault(i if key is None else key, []).append(i)
    for idx in together.values():
        if len(idx) >= CONCAT_ENCODE_MIN:
            _encode_together([items[i] for i in idx], copy)
            continue
        for i in idx:
            _encode_alone(*items[i], copy)
    for pairs in copies.values():
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
