"""codec.decode_ranges / encode_ranges_ (the held step's batched decode and encode): decode_ranges gives each range
exactly what decode_range gives it alone (ranges decoded one by one and by one kernel over their
concatenation); encode_ranges_ encodes alike ranges as one padded concatenation rounded from the first
range's seed, and the rest as encode_range_. Linear and dynamic entries, first and second moments,
stochastic and nearest rounding, fp32 and bf16 moments."""
import pytest
import torch

from slimfit.optim import codec


def _entries(dtype, sqrt, code, stochastic, sizes=(256, 300, 384, 72, 128, 512, 200)):
    g = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(sizes):
        t = torch.randn(n, generator=g).to(dtype)
        t = t.square() if sqrt else t
        out.append(codec.encode(t, sqrt=sqrt, seed=i, group_size=64, stochastic=stochastic, code=code))
    return out


def _ranges(entries):
    """Ranges of 128 (several per entry where it has them), some ending in a short group, in the middle too."""
    out = []
    for e in entries:
        n = e["shape"][0]
        out += [(e, a, min(n, a + 128)) for a in range(0, n, 128)]
    return out


@pytest.mark.parametrize("code", ["linear", "dynamic"])
@pytest.mark.parametrize("sqrt", [False, True], ids=["m", "v"])
@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_ranges_is_decode_range_of_each(code, sqrt, stochastic, dtype):
    ranges = _ranges(_entries(dtype, sqrt, code, stochastic))
    assert len(ranges) >= codec.CONCAT_DECODE_MIN
    got = codec.decode_ranges(ranges)
    for (e, a, b), x in zip(ranges, got):
        want = codec.decode_range(e, a, b)
        assert x.dtype == want.dtype and torch.equal(x, want)


def _items(entries, sqrt, first_seed=100):
    g = torch.Generator().manual_seed(1)
    items = []
    for k, (e, a, b) in enumerate(_ranges(entries)):
        x = torch.randn(b - a, generator=g)
        items.append((e, a, x.square() if sqrt else x, first_seed + k))
    return items


def _range_of(entry: dict, key: str, a: int, b: int) -> torch.Tensor:
    if key == "codes":
        return entry["codes"].view(-1)[a:b]
    g = int(entry["group_size"])
    return entry[key][a // g:-(-b // g)]


@pytest.mark.parametrize("code", ["linear", "dynamic"])
@pytest.mark.parametrize("sqrt", [False, True], ids=["m", "v"])
@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
def test_encode_ranges_is_one_encode_of_the_padded_concatenation(code, sqrt, stochastic):
    """Alike 8-bit ranges are encoded as one tensor: each range padded to whole groups with its last value,
    the ranges one after another, encoded with the first range's seed; each range's codes and group
    parameters are that encoding's, its groups its own (short tail groups included)."""
    entries = _entries(torch.float32, sqrt, code, stochastic)
    items = _items(entries, sqrt)
    assert len(items) >= codec.CONCAT_ENCODE_MIN and any(x.numel() % 64 for _, _, x, _ in items)
    parts = []
    for _, _, x, _ in items:
        parts += [x, x[-1:].expand(-x.numel() % 64)]
    whole = codec.encode(torch.cat(parts), sqrt=sqrt, seed=items[0][3], group_size=64, stochastic=stochastic,
                         code=code)
    codec.encode_ranges_([(e, a, x.clone(), seed) for e, a, x, seed in items])
    keys = ("codes", "absmax") if code == "dynamic" else ("codes", "scale", "offset")
    at = 0
    for e, a, x, _ in items:
        n = x.numel()
        for key in keys:
            assert torch.equal(_range_of(e, key, a, a + n), _range_of(whole, key, at, at + n)), key
        at += n + (-n % 64)


@pytest.mark.parametrize("code", ["linear", "dynamic"])
@pytest.mark.parametrize("sqrt", [False, True], ids=["m", "v"])
def test_a_range_alone_and_4_bit_ranges_are_encode_range_of_each(code, sqrt):
    """What is not encoded together (a range with no alike neighbour; 4-bit codes, two to a byte) is
    encode_range_ of each range with its own seed."""
    kinds = [("linear", 8)] if code == "linear" else [("dynamic", 8), ("dynamic", 4)]
    for code_, bits in kinds:
        sizes = (300,) if bits == 8 else (256, 300, 384, 72, 128, 512, 200)
        one = [codec.encode(torch.zeros(n), sqrt=sqrt, seed=0, group_size=64, code=code_, bits=bits) for n in sizes]
        many = [codec.encode(torch.zeros(n), sqrt=sqrt, seed=0, group_size=64, code=code_, bits=bits) for n in sizes]
        items = _items(many, sqrt)
        if bits == 8:
            items = items[:1]
        for (e1, a, _), (_, _, x, seed) in zip(_ranges(one), items):
            codec.encode_range_(e1, a, x.clone(), seed=seed)
        codec.encode_ranges_([(e, a, x.clone(), seed) for e, a, x, seed in items])
        for e1, e2 in zip(one, many):
            for key, value in e1.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, e2[key]), (code_, bits, key)
