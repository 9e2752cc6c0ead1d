"""The 8-bit moment codec: the error bounds codec.py states, on adversarial and on real AdamW state."""
import pytest
import torch

from slimfit.optim import codec

G = 128


def _groups(t: torch.Tensor, group_size: int = G) -> torch.Tensor:
    """Group index of every element of t (flattened)."""
    return torch.arange(t.numel()) // group_size


def _per_group(values: torch.Tensor, t: torch.Tensor, group_size: int = G) -> torch.Tensor:
    return values[_groups(t, group_size)].view(t.shape)


def _wide_second_moment(seed=0) -> torch.Tensor:
    """v over 70 decades (1e-60 .. 1e10 are not fp32; 1e-38 .. 1e5 are), zeros, a constant group, a short tail."""
    g = torch.Generator().manual_seed(seed)
    v = torch.exp(torch.empty(37, 61).uniform_(-87, 11, generator=g))   # 2257 elements: tail group of 81
    flat = v.view(-1)
    flat[:G] = 0.0                  # an all-zero group (no gradient there yet)
    flat[G:2 * G] = 0.25            # a constant group
    flat[2 * G:3 * G:7] = 0.0       # zeros inside a wide group
    flat[3 * G] = 3e4               # one large entry: every other entry of its group rounds near 0
    return v


@pytest.mark.parametrize("stochastic", [True, False])
def test_second_moment_bounds(stochastic):
    v = _wide_second_moment()
    entry = codec.encode(v, sqrt=True, seed=7, stochastic=stochastic)
    restored = codec.decode(entry)
    s, s_hat = v.sqrt(), restored.sqrt()
    step = _per_group(entry["scale"], v)
    loss = step if stochastic else step / 2
    top = _per_group(entry["offset"] + 255 * entry["scale"], v)   # the group's largest sqrt
    ulps = 1e-6 * top                                              # fp32 arithmetic of quantize / dequantize
    wide = step > 0
    assert (s_hat[wide] >= loss[wide] * (1 - 1e-6)).all()          # never below what rounding could lose
    assert ((s_hat - s).abs() <= loss + ulps).all()                # |ŝ - s| <= Δ (nearest: Δ / 2)
    assert (s_hat >= s / 2 * (1 - 1e-6)).all()                     # v̂ >= v / 4
    assert torch.equal(s_hat[~wide], s[~wide])                     # constant groups: s exactly
    assert (restored.view(-1)[:G] == 0).all()                      # the all-zero group stays zero
    positive = v > 0
    raw = codec.dequantize(codec.QuantizedTensor(entry["codes"], entry["scale"], entry["offset"], v.shape,
                                                 torch.float32, 8, G))
    assert ((raw == 0) & positive).any(), "the test data must contain values that plain dequantize zeroes"
    assert (restored[positive & wide] > 0).all()                   # ... which the floor restores above 0


def test_first_moment_bound_and_unbiased():
    g = torch.Generator().manual_seed(1)
    m = torch.randn(50, 77, generator=g) * torch.logspace(-8, 0, 77)   # magnitudes differ across a group
    entry = codec.encode(m, sqrt=False, seed=3)
    step = _per_group(entry["scale"], m)
    top = _per_group(entry["offset"].abs() + 255 * entry["scale"], m)
    assert ((codec.decode(entry) - m).abs() <= step + 1e-6 * top).all()
    mean = sum(codec.decode(codec.encode(m, sqrt=False, seed=s)) for s in range(64)) / 64
    assert ((mean - m).abs() <= 4 * step / 64 ** 0.5 + 1e-6 * top).all()   # stochastic rounding: unbiased


def test_seeded_and_reproducible():
    m = torch.randn(1000)
    a, b, c = (codec.encode(m, sqrt=False, seed=s) for s in (5, 5, 6))
    assert torch.equal(a["codes"], b["codes"]) and not torch.equal(a["codes"], c["codes"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_and_shapes(dtype):
    v = (torch.rand(3, 5, 70) * 1e-3).to(dtype)
    for sqrt in (True, False):
        out = codec.decode(codec.encode(v, sqrt=sqrt, seed=1))
        assert out.dtype == dtype and out.shape == v.shape


@pytest.mark.parametrize("numel", [1, 127, 128, 129, 40_000])
def test_encoded_bytes(numel):
    entry = codec.encode(torch.rand(numel), sqrt=True, seed=0)
    actual = sum(entry[k].numel() * entry[k].element_size() for k in ("codes", "scale", "offset"))
    assert actual == codec.encoded_nbytes(numel)
    assert codec.encoded_nbytes(128 * 1000) * 3.76 < 4 * 128 * 1000 < codec.encoded_nbytes(128 * 1000) * 3.77


def test_first_update_after_restore_at_most_twice_exact():
    """Real AdamW state: with the same m, |m / (sqrt(v̂) + eps)| <= 2 |m / (sqrt(v) + eps)| elementwise."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(300, 70))
    opt = torch.optim.AdamW([p], lr=1e-3)
    for i in range(20):
        p.grad = torch.randn_like(p) * torch.logspace(-9, 1, 70) * (i % 3)   # zero gradients every third step
        opt.step()
    m, v = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]
    v_hat = codec.decode(codec.encode(v, sqrt=True, seed=2))
    eps = 1e-8
    exact, restored = m / (v.sqrt() + eps), m / (v_hat.sqrt() + eps)
    assert (restored.abs() <= 2 * exact.abs() * (1 + 1e-5) + 1e-30).all()


def test_decode_reads_codes_cast_by_a_plain_load():
    """Optimizer.load_state_dict casts uint8 codes to the parameter's float dtype: decode reads them back."""
    v = torch.rand(1000) ** 4
    entry = codec.encode(v, sqrt=True, seed=0)
    cast = {**entry, "codes": entry["codes"].float()}
    assert torch.equal(codec.decode(cast), codec.decode(entry))
