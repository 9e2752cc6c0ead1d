"""slimfit::dequantize on every backend, bit for bit the reference: codes of the quantizer and arbitrary
ones, every output dtype, codes that start mid-word, strided scales; argument errors.
(Round trips and the properties of quantize's output: test_op_quantize.py.)"""
import pytest
import torch
from _backends import BITS, COMPARED, FLOATS, GROUP_SIZES, LAUNCHES, check, gen, randn

from slimfit.kernels import reference

SHAPES = [(1,), (), (7,), (3, 77), (2, 3, 5), (0, 5), (4, 256), (1000,), (5, 300)]


@pytest.mark.backend_grid(reason=f"{COMPARED}; {LAUNCHES}", reference=False,
                          interpreter={"group_size": (32,), "out_dtype": (torch.float64,)})
@pytest.mark.parametrize("out_dtype", FLOATS + [torch.float64], ids=str)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("bits", BITS)
def test_matches_reference(backend, bits, group_size, out_dtype):
    for i, shape in enumerate(SHAPES):
        x = randn(shape, seed=10 + i)
        stochastic = i % 2 == 0
        codes, scale, offset = (t.to(backend.device) for t in reference.quantize(x, bits, group_size, stochastic, 17))
        check(backend, "dequantize", codes, scale, offset, bits, group_size, list(shape), out_dtype)
    # arbitrary (non-quantizer) codes and scales; non-contiguous scale/offset
    g = gen(1)
    n = 1000
    ng = (n + group_size - 1) // group_size
    codes = torch.randint(0, 256, ((n * bits + 7) // 8,), dtype=torch.uint8, generator=g).to(backend.device)
    scale = (torch.rand(2 * ng, generator=g) * 1e-3).to(backend.device)[::2]
    offset = torch.randn(ng, 2, generator=g).to(backend.device)[:, 1]
    check(backend, "dequantize", codes, scale, offset, bits, group_size, [10, 100], out_dtype)


@pytest.mark.backend_grid(reason=COMPARED, reference=False)
@pytest.mark.parametrize("bits", BITS)
def test_misaligned_codes_and_strided_scales(backend, bits):
    n, group_size = 999, 64
    rc, rs, ro = reference.quantize(randn((n,), seed=3), bits, group_size, True, 9)
    # codes starting one byte into their storage: a vectorized kernel must take its unaligned path
    codes = torch.cat([torch.zeros(1, dtype=torch.uint8), rc]).to(backend.device)[1:]
    assert codes.data_ptr() % 8 != 0
    scale = torch.stack([rs, rs], dim=1).to(backend.device)[:, 1]
    offset = torch.stack([ro, -ro], dim=1).to(backend.device)[:, 0]
    assert not scale.is_contiguous()
    for dtype in FLOATS:
        got, _ = check(backend, "dequantize", codes, scale, offset, bits, group_size, [n], backend.out_dtype(dtype))
        assert torch.equal(got.cpu(), reference.dequantize(rc, rs, ro, bits, group_size, [n], got.dtype))


def test_invalid_arguments(backend):
    x = randn((100,), device=backend.device)
    codes, scale, offset = backend.quantize(x, 4, 32, False, 0)
    with pytest.raises(backend.errors, match="bytes"):
        backend.dequantize(codes[:10], scale, offset, 4, 32, [100], torch.float32)
    with pytest.raises(backend.errors, match="scale"):
        backend.dequantize(codes, scale[:1], offset, 4, 32, [100], torch.float32)
    with pytest.raises(backend.errors, match="float32"):
        backend.dequantize(codes, scale.double(), offset, 4, 32, [100], torch.float32)
    with pytest.raises(backend.errors, match="float32"):
        backend.dequantize(codes, scale.half(), offset, 4, 32, [100], torch.float32)
    with pytest.raises(backend.errors, match="uint8"):
        backend.dequantize(codes.to(torch.int32), scale, offset, 4, 32, [100], torch.float32)
    with pytest.raises(backend.errors, match="bits"):
        backend.dequantize(codes, scale, offset, 3, 32, [100], torch.float32)


def test_sizes_checked_before_allocating(backend):
    """A shape that does not match the parts fails before anything is allocated, naming the fix:
    2**40 elements for 300 code bytes must not first try to allocate 4 TiB (the CPU kernel did, and
    died in the allocator), a product beyond int64 must not wrap around to a small count, and a
    smaller shape or other bits must not read a prefix or reinterpret the codes."""
    codes, scale, offset = backend.quantize(randn((300,), device=backend.device), 8, 64, False, 0)
    for shape in ([2**40], [2**32, 2**32], [2**62, 4], [10], [299], [301], [3, 101]):
        with pytest.raises(backend.errors, match="code bytes do not match|more elements than int64") as info:
            backend.dequantize(codes, scale, offset, 8, 64, shape, torch.float32)
        assert "quantized with" in str(info.value)
    with pytest.raises(backend.errors, match="code bytes do not match"):
        backend.dequantize(codes, scale, offset, 4, 64, [300], torch.float32)  # 8-bit codes read as 4-bit
    with pytest.raises(backend.errors, match="groups of scale/offset"):
        backend.dequantize(codes, scale, offset, 8, 32, [300], torch.float32)
    with pytest.raises(backend.errors, match="groups of scale/offset"):
        backend.dequantize(codes, torch.cat([scale, scale]), offset, 8, 64, [300], torch.float32)
    empty = backend.dequantize(codes[:0], scale[:0], offset[:0], 8, 64, [2**40, 0], torch.float32)
    assert empty.shape == (2**40, 0)  # no elements, however large the other dimension


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy overflow in the interpreter's code * scale
@pytest.mark.parametrize("bits", BITS)
def test_overflow_with_finite_scale_saturates(backend, bits):
    """code * scale + offset beyond fp32 with a finite scale and offset: computed a quarter down, so the
    upper codes of a group spanning [-FLT_MAX, FLT_MAX] come back exactly (code * scale alone
    overflows), and a value beyond fp32 saturates at -FLT_MAX instead of becoming -inf."""
    top = torch.finfo(torch.float32).max
    levels = 2**bits - 1
    code = torch.arange(32) * levels // 31                      # 0 .. levels
    codes = reference._pack_codes(torch.cat([code, code]), bits).to(backend.device)
    scale = torch.tensor([2 * top / levels, -top], device=backend.device)
    offset = torch.tensor([-top, -top / 2], device=backend.device)
    y, _ = check(backend, "dequantize", codes, scale, offset, bits, 32, [64], torch.float32)
    want = [-top + c * (2 * top / levels) for c in code.tolist()]  # exact in fp32: no rounding anywhere
    want += [-top / 2 if c == 0 else -top for c in code.tolist()]
    assert y.cpu().tolist() == want


def test_any_layout_of_the_parts(backend):
    """codes, scale and offset are read as their elements in order, whatever their shape: 2-d codes and
    a 0-d scale and offset (one group) dequantize as the flat ones do (the reference raised on them)."""
    codes, scale, offset = backend.quantize(randn((32,), device=backend.device), 8, 32, False, 0)
    want = backend.dequantize(codes, scale, offset, 8, 32, [32], torch.float32)
    got, _ = check(backend, "dequantize", codes.view(4, 8), scale[0], offset[0], 8, 32, [32], torch.float32)
    assert torch.equal(got, want)
