"""The reference kernels against the properties the specification promises.

These tests pin the semantics every backend must reproduce: round-trip error, unbiased
stochastic rounding, exact constant groups, packing layout, top-k against torch.topk,
and the wrappers' errors. Backends are compared with the reference in their own modules.
"""
import math

import pytest
import torch

from slimfit import kernels as K
from slimfit.kernels import reference as R
from slimfit.kernels import rng

SHAPES = [(1,), (7,), (3, 77), (2, 3, 5), (4, 256), (1000,)]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nearest_round_trip_within_half_step(bits, group_size, shape, dtype):
    x = (torch.randn(shape) * 3).to(dtype)
    q = K.quantize(x, bits, group_size)
    y = K.dequantize(q)
    assert y.dtype == dtype and y.shape == x.shape
    n = x.numel()
    group = torch.arange(n) // group_size
    err = (y.float() - x.float()).reshape(-1).abs()
    # half a step, plus the rounding of the output dtype and of fp32 arithmetic
    out_eps = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    # (the output rounding is relative to the dequantized value, which may exceed |x| by half a step)
    magnitude = torch.maximum(x.float().reshape(-1).abs(), y.float().reshape(-1).abs())
    bound = q.scale[group] / 2 * (1 + 1e-5) + magnitude * out_eps + 1e-6
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packed_sizes_and_layout(bits):
    n = 37
    x = torch.linspace(-1, 1, n)
    q = K.quantize(x, bits, 32)
    per = 8 // bits
    assert q.codes.dtype == torch.uint8 and q.codes.numel() == math.ceil(n / per)
    assert q.scale.numel() == q.offset.numel() == math.ceil(n / 32)
    codes = R._unpack_codes(q.codes, bits, n)
    # element 0 in the lowest bits of byte 0
    assert int(q.codes[0]) & ((1 << bits) - 1) == int(codes[0])
    # unused high bits of the last byte are zero
    used = n - (q.codes.numel() - 1) * per
    assert int(q.codes[-1]) >> (used * bits) == 0


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_constant_and_zero_groups_are_exact(bits):
    x = torch.cat([torch.full((64,), 3.25), torch.zeros(64), torch.full((5,), -7.5)])
    for stochastic in (False, True):
        q = K.quantize(x, bits, 32, stochastic=stochastic, seed=1)
        assert torch.equal(K.dequantize(q), x)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_stochastic_rounding_is_unbiased(bits):
    torch.manual_seed(0)
    x = torch.randn(4, 64)
    seeds = 400
    acc = torch.zeros_like(x, dtype=torch.float64)
    for s in range(seeds):
        acc += K.dequantize(K.quantize(x, bits, 64, stochastic=True, seed=s)).double()
    mean = acc / seeds
    step = K.quantize(x, bits, 64).scale.max().item()
    # per-element std of the mean <= step / (2 sqrt(seeds)); allow 5 sigma
    assert (mean - x.double()).abs().max().item() < 5 * step / (2 * math.sqrt(seeds))
    # and the bias over all elements is a tiny fraction of a step
    assert abs((mean - x.double()).mean().item()) < 0.01 * step


def test_stochastic_rounding_is_reproducible_and_seed_dependent():
    x = torch.randn(1000)
    a = K.quantize(x, 4, 128, stochastic=True, seed=123)
    b = K.quantize(x, 4, 128, stochastic=True, seed=123)
    c = K.quantize(x, 4, 128, stochastic=True, seed=124)
    assert torch.equal(a.codes, b.codes)
    assert not torch.equal(a.codes, c.codes)


def test_non_contiguous_input_matches_contiguous_copy():
    x = torch.randn(64, 48).t()[:, 3:]
    assert not x.is_contiguous()
    a = K.quantize(x, 4, 64)
    b = K.quantize(x.contiguous(), 4, 64)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)


def test_empty_tensor_round_trip():
    x = torch.randn(0, 5)
    q = K.quantize(x, 8, 128)
    assert q.codes.numel() == 0 and K.dequantize(q).shape == (0, 5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises_when_checked(bad):
    x = torch.randn(300)
    x[257] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        K.quantize(x, 8, 128, check_finite=True)
    with pytest.raises(ValueError, match="NaN or Inf"):
        K.topk_prune(x.view(3, 100), k=3, check_finite=True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_unchecked_non_finite_group_dequantizes_non_finite(bad):
    """check_finite is off by default (no host sync): a bad group must then stay visibly bad
    (every element of it non-finite after the round trip), the other groups exact as usual."""
    x = torch.randn(300)
    x[257] = bad
    for bits in (2, 4, 8):
        q = K.quantize(x, bits, 128)
        y = K.dequantize(q)
        assert not torch.isfinite(y[256:300]).any()
        assert torch.isfinite(y[:256]).all()
    kept = K.topk_restore(K.topk_prune(x.view(3, 100), k=3))
    assert kept.isnan().any() if bad != bad else kept.isinf().any()


@pytest.mark.parametrize("huge", [3e38, -3e38])
def test_finite_overflowing_range_is_not_called_nan(huge):
    """+-3e38 is finite, but max - min overflows fp32: the error must say so, not 'NaN or Inf'."""
    x = torch.randn(256)
    x[5] = huge
    x[6] = -huge
    with pytest.raises(ValueError, match="exceeds the largest float32") as info:
        K.quantize(x, 8, 128, check_finite=True)
    assert "NaN or Inf" not in str(info.value)
    K.quantize(x[128:], 8, 128, check_finite=True)  # the other group alone is fine


def test_quantize_argument_errors():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="bits"):
        K.quantize(x, 3, 128)
    with pytest.raises(ValueError, match="group_size"):
        K.quantize(x, 8, 100)
    with pytest.raises(TypeError, match="dtype"):
        K.quantize(x.double(), 8, 128)
    with pytest.raises(TypeError, match="dtype"):
        K.quantize(torch.arange(10), 8, 128)


@pytest.mark.parametrize("shape,k", [((1, 1), 1), ((3, 77), 1), ((3, 77), 8), ((3, 77), 77), ((2, 4, 128), 13)])
@pytest.mark.parametrize("by_magnitude", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_topk_matches_torch_topk(shape, k, by_magnitude, dtype):
    x = torch.randn(shape).to(dtype)
    p = K.topk_prune(x, k=k, by_magnitude=by_magnitude)
    key = (x.abs() if by_magnitude else x).float()
    ref = torch.topk(key, k, dim=-1)
    kept_keys = torch.gather(key, -1, p.indices.long())
    # equal index sets up to ties: same multiset of kept keys, and nothing dropped beats a kept one
    assert torch.equal(torch.sort(kept_keys, dim=-1).values, torch.sort(ref.values, dim=-1).values)
    dropped = key.scatter(-1, p.indices.long(), float("-inf"))
    assert bool((dropped.amax(-1) <= kept_keys.amin(-1)).all())
    assert bool((p.indices[..., 1:] > p.indices[..., :-1]).all())  # ascending
    assert p.values.dtype == dtype and p.indices.dtype == torch.int16
    assert torch.equal(p.values, torch.gather(x, -1, p.indices.long()))
    dense = K.topk_restore(p)
    expect = torch.zeros_like(x).scatter(-1, p.indices.long(), p.values)
    assert torch.equal(dense, expect)


def test_topk_ties_keep_lowest_indices():
    x = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0, 2.0]])
    p = K.topk_prune(x, k=3, by_magnitude=False)
    assert p.indices.tolist() == [[1, 2, 4]]


def test_topk_index_dtype_switches_to_int32_for_long_rows():
    x = torch.randn(2, 40000)
    p = K.topk_prune(x, k=5)
    assert p.indices.dtype == torch.int32
    assert torch.equal(K.topk_restore(p).ne(0).sum(-1), torch.tensor([5, 5]))


def test_topk_argument_errors():
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="k must be"):
        K.topk_prune(x, k=11)
    with pytest.raises(ValueError, match="ratio"):
        K.topk_prune(x, ratio=0.0)
    with pytest.raises(ValueError, match="exactly one"):
        K.topk_prune(x)
    assert K.topk_prune(x, ratio=0.1).values.shape == (2, 1)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1001])
def test_pack_bits_round_trip_and_size(n):
    m = torch.rand(n) > 0.5
    packed = K.pack_bits(m)
    assert packed.numel() == math.ceil(n / 8)
    assert torch.equal(K.unpack_bits(packed, (n,)), m)


def test_pack_bits_layout():
    m = torch.tensor([True, False, False, False, False, False, False, False, True])
    assert K.pack_bits(m).tolist() == [1, 1]


def test_rng_matches_scalar_hash():
    seed = 2**40 + 17
    k0, k1 = rng.seed_keys(seed)
    words = rng.random_words(seed, 5, "cpu")
    for i in range(5):
        w = rng.lowbias32_int(rng.lowbias32_int(i ^ k0) ^ 0 ^ k1)
        assert int(words[i]) == w


def test_uniform_is_uniform():
    u = rng.uniform(7, 200_000, "cpu")
    assert 0.0 <= u.min().item() and u.max().item() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.005
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (hist - 0.1).abs().max().item() < 0.005


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
def test_seeded_dropout(p):
    x = torch.randn(50, 40)
    y = K.seeded_dropout(x, p, seed=11)
    mask = K.dropout_mask(x, p, seed=11)
    assert torch.equal(y, K.seeded_dropout(x, p, seed=11))
    if p == 1.0:
        assert torch.equal(y, torch.zeros_like(x))
        return
    assert torch.equal(y != 0, mask & (x != 0))
    torch.testing.assert_close(y[mask], x[mask] / (1 - p), rtol=1e-6, atol=0)
    assert abs(mask.float().mean().item() - (1 - p)) < 0.02


def test_dropout_p_error():
    with pytest.raises(ValueError, match="p must be"):
        K.seeded_dropout(torch.randn(3), 1.5, 0)
