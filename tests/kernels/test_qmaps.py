"""The code maps of block-wise dynamic quantization (slimfit/kernels/qmaps.py): the levels its docstring
states, and the properties the optimizer codec relies on (0 and +-1 in the signed map, no 0 in the unsigned)."""
import pytest
import torch

from slimfit.kernels import qmaps

# (map, bits): (smallest positive level, largest level, top-decade step) as the module docstring's table says
DOCUMENTED = {
    ("signed", 8): (1e-7, 1.0, 0.9 / 64),
    ("signed", 4): (1e-3, 1.0, 0.9 / 4),
    ("unsigned", 8): (1e-8, 1.0, 0.9 / 128),
    ("unsigned", 4): (1e-4, 1.0, 0.9 / 8),
    ("linear_unsigned", 4): (0.0625, 1.0, 0.0625),
}


@pytest.mark.parametrize("kind,bits", list(DOCUMENTED), ids=str)
def test_documented_levels(kind, bits):
    q = qmaps.MAPS[kind](bits)
    smallest, largest, step = DOCUMENTED[(kind, bits)]
    assert q.dtype == torch.float32 and q.shape == (2**bits,)
    assert bool((q[1:] > q[:-1]).all())
    assert q[q > 0].min().item() == pytest.approx(smallest, rel=1e-6) and q[-1].item() == largest
    assert (q[-1] - q[-2]).item() == pytest.approx(step, rel=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
def test_signed_map_is_the_dynamic_tree(bits):
    """0 and +-1 are levels; the map is symmetric but for one extra positive level a decade below the rest;
    each decade holds half the levels of the one above."""
    q = qmaps.signed(bits).double()
    assert q[0] == -1 and 0.0 in q.tolist()
    pos, neg = q[q > 0], -q[q < 0].flip(0)
    assert torch.allclose(pos[1:], neg) and pos[0].item() == pytest.approx(10.0 ** -(bits - 1), rel=1e-6)
    top = [10.0 ** -e * (1 + 1e-6) for e in range(bits)]   # a decade (10^-(e+1), 10^-e], fp32 levels a hair above
    counts = [int(((neg > top[e + 1]) & (neg <= top[e])).sum()) for e in range(bits - 1)]
    assert counts == [2 ** (bits - 2 - e) for e in range(bits - 1)]


@pytest.mark.parametrize("bits", [8, 4])
def test_unsigned_map_has_no_zero(bits):
    q = qmaps.unsigned(bits)
    assert bool((q > 0).all()) and q[0].item() == pytest.approx(10.0 ** -bits, rel=1e-6)


def test_code_of_zero_is_what_the_kernel_gives_zero():
    for kind in ("signed", "unsigned"):
        for bits in (8, 4):
            codes, _ = torch.ops.slimfit.quantize_blockwise(torch.zeros(2), qmaps.MAPS[kind](bits), 32)
            assert int(codes[0]) & (2**bits - 1) == qmaps.code_of_zero(kind, bits)


def test_maps_are_copies_and_device_maps_cached():
    a = qmaps.signed(8)
    a[0] = 5.0
    assert qmaps.signed(8)[0] == -1
    x = torch.zeros(3)
    assert qmaps.on_device("unsigned", 4, x) is qmaps.on_device("unsigned", 4, x)


def test_fake_tensors_get_an_empty_map_of_the_right_size():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        like = torch.empty(10)
        q = qmaps.on_device("signed", 4, like)
        codes, absmax = torch.ops.slimfit.quantize_blockwise(like, q, 64)
    assert isinstance(q, FakeTensor) and q.shape == (16,)
    assert codes.shape == (5,) and absmax.shape == (1,)


def test_bits_must_be_4_or_8():
    with pytest.raises(ValueError, match="4 or 8"):
        qmaps.signed(2)
