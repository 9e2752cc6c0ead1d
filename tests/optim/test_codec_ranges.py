"""codec.decode_ranges / encode_ranges_ (the held step's batched decode and encode) give each range exactly what
decode_range / encode_range_ give it alone: linear and dynamic entries, first and second moments, stochastic
and nearest rounding, fp32 and bf16 moments, ranges decoded one by one and by one kernel over their
concatenation."""
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


@pytest.mark.parametrize("code", ["linear", "dynamic"])
@pytest.mark.parametrize("sqrt", [False, True], ids=["m", "v"])
@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
def test_encode_ranges_is_encode_range_of_each(code, sqrt, stochastic):
    one, many = _entries(torch.float32, sqrt, code, stochastic), _entries(torch.float32, sqrt, code, stochastic)
    g = torch.Generator().manual_seed(1)
    items = []
    for k, ((e1, a, b), (e2, _, _)) in enumerate(zip(_ranges(one), _ranges(many))):
        x = torch.randn(b - a, generator=g)
        x = x.square() if sqrt else x
        codec.encode_range_(e1, a, x.clone(), seed=100 + k)
        items.append((e2, a, x.clone(), 100 + k))
    codec.encode_ranges_(items)
    for e1, e2 in zip(one, many):
        for key, value in e1.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, e2[key]), key
