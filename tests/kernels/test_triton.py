"""Every Triton launcher vs the reference, bit for bit (torch.equal).

On CUDA the kernels run on the GPU; without CUDA they run on CPU tensors under
TRITON_INTERPRET=1 (marked `triton_interpret`; small shapes, the module stays well under
a minute and a half). bf16 is checked on CUDA only: the interpreter's bf16 is not faithful.
"""
import importlib
import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from slimfit.kernels import reference, rng  # noqa: E402
from slimfit.kernels.validation import topk_index_dtype  # noqa: E402

try:
    import slimfit.kernels.triton as K  # noqa: E402
    from slimfit.kernels.triton import _rng, topk as topk_mod  # noqa: E402
except Exception as exc:  # pragma: no cover - a triton too old for the kernels
    pytest.skip(f"slimfit Triton kernels not importable: {exc}", allow_module_level=True)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
if DEVICE == "cpu" and not INTERPRET:
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set", allow_module_level=True)

pytestmark = [pytest.mark.triton_interpret] if INTERPRET else []

FLOATS = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
OPS = ["quantize", "dequantize", "topk_prune", "topk_restore", "pack_bits", "unpack_bits",
       "dropout_mask", "seeded_dropout"]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _randn(shape, dtype, seed=0, scale=3.0):
    return (torch.randn(shape, generator=_gen(seed)) * scale).to(dtype).to(DEVICE)


def _assert_same(got, want):
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        assert g.shape == w.shape, (g.shape, w.shape)
        assert g.device == w.device
        assert torch.equal(g, w), f"mismatch at {(g != w).nonzero()[:5].tolist()}"


# ------------------------------------------------------------------------- registry
@pytest.mark.parametrize("op", OPS)
def test_launcher_signature_matches_reference(op):
    got = list(inspect.signature(getattr(K, op)).parameters)
    want = list(inspect.signature(getattr(reference, op)).parameters)
    assert got == want


# ------------------------------------------------------------------------------ rng
@triton.jit(do_not_specialize=["k0", "k1"])
def _words_kernel(idx_ptr, out_ptr, n, k0, k1, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    idx = tl.load(idx_ptr + offs, mask=offs < n, other=0)
    w = _rng.random_words(idx, k0, k1)
    tl.store(out_ptr + offs, w.to(tl.int64), mask=offs < n)


@pytest.mark.parametrize("seed", [0, 1, 2**31, 2**32 + 5, 2**63 - 1])
def test_rng_words_match_reference_including_high_indices(seed):
    idx = torch.tensor([0, 1, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 3, 2**40 + 12345,
                        2**62 + 99], dtype=torch.int64, device=DEVICE)
    out = torch.empty_like(idx)
    _words_kernel[(1,)](idx, out, idx.numel(), *_rng.seed_key_args(seed), BLOCK=16)
    k0, k1 = rng.seed_keys(seed)
    want = rng.lowbias32(rng.lowbias32((idx & rng.MASK32) ^ k0) ^ (idx >> 32) ^ k1)
    _assert_same(out, want)


# ------------------------------------------------------------------------- quantize
QUANT_SHAPES = [(1,), (37,), (3, 100)]


def _check_quant(x, bits, group_size, stochastic, seed=1234):
    got = K.quantize(x, bits, group_size, stochastic, seed)
    want = reference.quantize(x, bits, group_size, stochastic, seed)
    _assert_same(got, want)
    meta = (bits, group_size, tuple(x.shape), x.dtype)
    _assert_same(K.dequantize(*got, *meta[:2], meta[2], meta[3]),
                 reference.dequantize(*want, *meta[:2], meta[2], meta[3]))
    return got


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("group_size", [32, 256])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_dequantize_bit_exact(bits, group_size, dtype, stochastic):
    for i, shape in enumerate(QUANT_SHAPES):
        _check_quant(_randn(shape, dtype, seed=i), bits, group_size, stochastic)


@pytest.mark.parametrize("group_size", [64, 128])
def test_quantize_other_group_sizes_and_several_programs(group_size):
    # 4096 // 64 = 64 groups per program: 3 programs, the last one partial.
    x = _randn((2 * 4096 + 77,), torch.float32, seed=3)
    _check_quant(x, 4, group_size, True)


def _launch_quantize(x, bits, group_size, stochastic, seed, even, idx64):
    """The quantize kernel with its EVEN / IDX64 variants forced (the launcher picks them by size)."""
    qmod = importlib.import_module("slimfit.kernels.triton.quantize")
    n = x.numel()
    ng = -(-n // group_size)
    nbytes = -(-n // (8 // bits))
    codes = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    scale = torch.empty(ng, dtype=torch.float32, device=x.device)
    offset = torch.empty(ng, dtype=torch.float32, device=x.device)
    cfg = qmod.launch_config(group_size, ng, stochastic)
    qmod._quantize_kernel[(-(-ng // cfg.groups),)](
        x, codes, scale, offset, n, ng, nbytes, *_rng.seed_key_args(seed),
        **cfg.constexprs(bits, group_size, stochastic, even=even, idx64=idx64),
        num_warps=cfg.num_warps, enable_fp_fusion=False)
    return codes, scale, offset


@pytest.mark.parametrize("idx64", [False, True], ids=["int32", "int64"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_quantize_even_and_int64_variants(stochastic, idx64):
    """EVEN (no masks) and IDX64 (int64 program base) are chosen by tensor size; forced here on
    small tensors, each must give the reference's bits."""
    bits = 2 if stochastic else 8
    for n, even in ((2 * 4096, True), (2 * 4096 + 77, False)):
        x = _randn((n,), torch.float32, seed=n)
        got = _launch_quantize(x, bits, 128, stochastic, 99, even, idx64)
        _assert_same(got, reference.quantize(x, bits, 128, stochastic, 99))


@triton.jit
def _hoisted_uniform_kernel(base_ptr, out_ptr, k0, k1, BLOCK: tl.constexpr):
    base = tl.load(base_ptr)
    offs = tl.arange(0, BLOCK)
    lo = (base + offs).to(tl.uint32)
    hk1 = (base >> 32).to(tl.uint32) ^ k1.to(tl.uint32, bitcast=True)
    tl.store(out_ptr + offs, _rng.uniform_hoisted(lo, hk1, k0))


@pytest.mark.parametrize("base", [0, 2**31, 2**32 - 64, 2**32, 2**40 + 2**20], ids=str)
def test_hoisted_uniform_matches_rng_beyond_2_32(base):
    """Stochastic quantize folds hi32(index) into the key once per program (blocks are aligned
    to a power of two, so they never straddle 2**32): same uniforms as rng.uniform."""
    k0, k1 = _rng.seed_key_args(7)
    out = torch.empty(64, dtype=torch.float32, device=DEVICE)
    _hoisted_uniform_kernel[(1,)](torch.tensor([base], dtype=torch.int64, device=DEVICE), out, k0, k1, BLOCK=64)
    idx = torch.arange(base, base + 64, dtype=torch.int64)
    kk0, kk1 = rng.seed_keys(7)
    want = (rng.lowbias32(rng.lowbias32((idx & rng.MASK32) ^ kk0) ^ (idx >> 32) ^ kk1) >> 8).to(torch.float32) * rng.INV_2_24
    _assert_same(out.cpu(), want)


@pytest.mark.parametrize("bits", [2, 8])
def test_quantize_non_contiguous_and_constant_groups(bits):
    x = _randn((40, 9), torch.float32, seed=4).t()          # non-contiguous
    assert not x.is_contiguous()
    _check_quant(x, bits, 32, False)
    x = torch.full((70,), 2.5, device=DEVICE)               # scale 0 -> divisor 1
    x[64:] = -1.0
    _check_quant(x, bits, 32, True)


@pytest.mark.skipif(DEVICE == "cuda", reason="covered by the bf16 cases above on CUDA")
def test_bf16_inputs_under_interpreter():
    # The interpreter's fp32 -> bf16 cast truncates, so only bf16 *inputs* are checked here:
    # quantize (codes, scales, offsets), dequantize to fp32, top-k.
    x = _randn((3, 70), torch.bfloat16, seed=8)
    for stochastic in (False, True):
        got = K.quantize(x, 4, 32, stochastic, 5)
        want = reference.quantize(x, 4, 32, stochastic, 5)
        _assert_same(got, want)
        _assert_same(K.dequantize(*got, 4, 32, (3, 70), torch.float32),
                     reference.dequantize(*want, 4, 32, (3, 70), torch.float32))
    _check_topk(_ties((2, 50), torch.bfloat16), 7, True)


def test_quantize_stochastic_depends_on_seed():
    x = _randn((256,), torch.float32, seed=5)
    a = K.quantize(x, 2, 32, True, 1)[0]
    b = K.quantize(x, 2, 32, True, 1)[0]
    c = K.quantize(x, 2, 32, True, 2)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_quantize_empty_and_dequantize_to_other_dtype():
    for shape in [(0,), (3, 0)]:
        x = torch.empty(shape, device=DEVICE)
        _check_quant(x, 4, 32, False)
    x = _randn((50,), torch.float32, seed=6)
    q = K.quantize(x, 8, 32, False, 0)
    _assert_same(K.dequantize(*q, 8, 32, (5, 10), torch.float64),
                 reference.dequantize(*q, 8, 32, (5, 10), torch.float64))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN/Inf arithmetic in the interpreter
def test_quantize_nan_and_inf_groups_are_non_finite():
    x = _randn((4 * 32,), torch.float32, seed=7)
    x[5] = float("nan")
    x[40] = float("inf")
    x[70] = float("-inf")
    for stochastic in (False, True):
        codes, scale, offset = K.quantize(x, 4, 32, stochastic, 9)
        bad = ~(torch.isfinite(scale) & torch.isfinite(offset))
        assert bad.tolist() == [True, True, True, False]
        assert torch.isnan(scale[0]) and torch.isnan(offset[0])
        want = reference.quantize(x, 4, 32, stochastic, 9)
        _assert_same(scale[3:], want[1][3:])
        _assert_same(offset[3:], want[2][3:])
        _assert_same(codes[48:], want[0][48:])              # codes of the finite group


# ----------------------------------------------------------------------------- top-k
def _bits(t):
    """Floats as their bits: NaN equals NaN, -0.0 differs from +0.0."""
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()]) if t.is_floating_point() else t


def _check_topk(x, k, by_magnitude):
    got = K.topk_prune(x, k, by_magnitude)
    want = reference.topk_prune(x, k, by_magnitude)
    assert [g.dtype for g in got] == [w.dtype for w in want]
    _assert_same([_bits(g) for g in got], [_bits(w) for w in want])
    row = x.shape[-1]
    _assert_same(_bits(K.topk_restore(*got, row)), _bits(reference.topk_restore(*want, row)))


def _ties(shape, dtype, seed=0):
    return torch.randint(-3, 4, shape, generator=_gen(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("by_magnitude", [False, True], ids=["value", "magnitude"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 3, 33), (4, 300)], ids=str)
def test_topk_bit_exact_with_ties(shape, by_magnitude):
    row = shape[-1]
    for k in sorted({1, max(1, row // 3), row}):
        _check_topk(_ties(shape, torch.float32, seed=k), k, by_magnitude)
    _check_topk(_randn(shape, torch.float32), max(1, row // 2), by_magnitude)


@pytest.mark.parametrize("dtype", [d for d in FLOATS if d != torch.float32], ids=str)
def test_topk_half_precision_and_non_contiguous(dtype):
    _check_topk(_ties((5, 40), dtype), 9, True)
    x = _randn((33, 6), dtype).t()
    assert not x.is_contiguous()
    _check_topk(x, 4, False)


def test_topk_signed_zeros_infinities_nan():
    x = torch.tensor([[0.0, -0.0, -0.0, 0.0, 1.0, -1.0, float("inf"), -float("inf"), 1.0]],
                     device=DEVICE)
    for k in (1, 3, 5, 9):
        _check_topk(x, k, False)
        _check_topk(x, k, True)
    # NaN sorts above +inf in torch.sort; all NaNs tie (values compared by their bits).
    x = torch.tensor([[1.0, float("nan"), float("inf"), -float("nan"), 2.0]], device=DEVICE)
    for by_magnitude in (False, True):
        for k in (1, 2, 3, 5):
            _check_topk(x, k, by_magnitude)


def test_topk_restore_row_length_zero_raises():
    v = torch.randn(3, 2, device=DEVICE)
    i = torch.zeros(3, 2, dtype=torch.int16, device=DEVICE)
    with pytest.raises(ValueError, match="row_length is 0"):
        K.topk_restore(v, i, 0)
    _assert_same(K.topk_restore(v[:, :0], i[:, :0], 0), reference.topk_restore(v[:, :0], i[:, :0], 0))


def test_topk_empty():
    _check_topk(torch.empty((0, 5), device=DEVICE), 2, True)
    _check_topk(torch.empty((3, 0), device=DEVICE), 1, False)


def test_topk_chunked_rows(monkeypatch):
    # Force several chunks on a short row (a partial last chunk, and an exact fit: EVEN).
    monkeypatch.setattr(topk_mod, "REGISTER_ROW_MAX", 64)
    monkeypatch.setattr(topk_mod, "CHUNK", 64)
    for row in (150, 128):
        cfg = topk_mod.tile_config(row)
        assert (cfg.block, cfg.n_chunks) == (64, triton.cdiv(row, 64))
        x = _ties((2, row), torch.float32, seed=11)
        _check_topk(x, 61, True)
        _check_topk(x, row, False)
        _check_topk(x, 1, False)


@pytest.mark.parametrize("row, chunks", [(197, [256]), (768, [256] * 3), (2048, [2048]), (3000, [1024] * 3),
                                         (8192, [8192]), (8193, [4096] * 3), (65536, [4096] * 16), (7, [16])])
def test_topk_tile_config_pads_no_row_to_a_power_of_two(row, chunks):
    cfg = topk_mod.tile_config(row, 1000)
    assert [cfg.block] * cfg.n_chunks == chunks
    assert cfg.num_warps == max(1, min(16, cfg.block // 256))
    assert cfg.constexprs(True)["EVEN"] == (row == cfg.block * cfg.n_chunks)


def _ties_nan_inf(shape, seed):
    """Small integers (many ties), +-0.0, +-inf and NaNs of both signs, at random places."""
    g = _gen(seed)
    x = torch.randint(-3, 4, shape, generator=g).to(torch.float32)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan")])
    where = torch.rand(shape, generator=g) < 0.1
    x[where] = specials[torch.randint(0, len(specials), (int(where.sum()),), generator=g)]
    return x.to(DEVICE)


@pytest.mark.parametrize("by_magnitude", [False, True], ids=["value", "magnitude"])
@pytest.mark.parametrize("shape", [(3, 197), (2, 768), (2, 2048)], ids=str)
def test_topk_model_row_lengths(shape, by_magnitude):
    # 197 (ViT-B/16 tokens: one masked chunk of 256), 768 (3 chunks of 256), 2048 (one chunk)
    row = shape[-1]
    x = _ties_nan_inf(shape, seed=row)
    for k in (1, 2, row // 10, row // 2, row - 1, row):
        _check_topk(x, k, by_magnitude)
    _check_topk(_randn(shape, torch.float32, seed=row), row // 10, by_magnitude)


def test_topk_long_row_ties_nan_inf():
    # A row longer than REGISTER_ROW_MAX: 3 chunks of CHUNK (the last one partial).
    x = _ties_nan_inf((2, 9000), seed=13)
    assert topk_mod.tile_config(9000).n_chunks == 3
    for k in (1, 900, 9000):
        _check_topk(x, k, False)
        _check_topk(x, k, True)


def test_topk_radix_digits_split_late():
    # Keys equal in their top 24 bits (the first three radix passes tie) and in all 32.
    base = torch.tensor(1.0).view(torch.int32).item()
    words = torch.tensor([base + d for d in (5, 3, 5, 0, 255, 3, 5, 1, 255, 0)], dtype=torch.int32)
    x = words.view(torch.float32).repeat(3, 1).to(DEVICE)
    x[1] = -x[1]
    for k in range(1, 11):
        _check_topk(x, k, False)
        _check_topk(x, k, True)


def test_topk_int32_indices_long_row(monkeypatch):
    if INTERPRET:  # fewer, larger chunks: the interpreter pays per operation
        monkeypatch.setattr(topk_mod, "CHUNK", 32768)
    x = _ties((1, 40000), torch.float32, seed=12)
    x[0, 39990] = 10.0
    v, i = K.topk_prune(x, 1000, True)
    assert i.dtype == torch.int32
    _check_topk(x, 1000, True)


@pytest.mark.parametrize("row, k, n_rows", [(197, 19, 45), (768, 76, 7), (3, 3, 1500), (5000, 500, 2),
                                            (10, 20, 3)])
def test_topk_restore_whole_rows(row, k, n_rows):
    # Several rows per program (and a partial last program), one long row in chunks, and
    # more kept entries than the row is long (duplicates; out-of-range indices are dropped).
    cfg = topk_mod.restore_config(row, k, n_rows)
    assert cfg.rows * max(row, k) <= max(topk_mod.RESTORE_BLOCK, max(row, k))
    g = _gen(row)
    values = torch.randn(n_rows, k, generator=g).to(DEVICE)
    if k <= row:
        idx = torch.stack([torch.randperm(row, generator=g)[:k].sort().values for _ in range(n_rows)])
        idx = idx.to(topk_index_dtype(row)).to(DEVICE)
        out = K.topk_restore(values, idx, row)
        _assert_same(out, reference.topk_restore(values, idx, row))
    else:
        idx = torch.arange(k).repeat(n_rows, 1).to(torch.int16).to(DEVICE)   # 0..k-1: k - row dropped
        out = K.topk_restore(values, idx, row)
        _assert_same(out, values[:, :row])


def test_topk_restore_writes_every_element(monkeypatch):
    # The kernel writes zeros itself: the output buffer may hold anything before.
    new_empty = torch.Tensor.new_empty

    def poisoned(self, *args, **kwargs):
        t = new_empty(self, *args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned)
    x = _ties((6, 197), torch.float32, seed=3)
    got = K.topk_prune(x, 20, True)
    _assert_same(K.topk_restore(*got, 197), reference.topk_restore(*reference.topk_prune(x, 20, True), 197))


@triton.jit
def _row_of_kernel(offs_ptr, out_ptr, length, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(out_ptr + o, topk_mod._row_of(tl.load(offs_ptr + o), length))


@pytest.mark.parametrize("length", [1, 3, 7, 197, 768, 1000, 4095])
def test_row_of_is_exact(length):
    offs = torch.arange(8192, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(offs)
    _row_of_kernel[(1,)](offs, out, length, BLOCK=8192)
    assert torch.equal(out, offs // length)


# ----------------------------------------------------------------------- bit masks
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 9000])
def test_pack_unpack_bits(n):
    m = (torch.rand(n, generator=_gen(n)) > 0.5).to(DEVICE)
    packed = K.pack_bits(m)
    _assert_same(packed, reference.pack_bits(m))
    _assert_same(K.unpack_bits(packed, n), reference.unpack_bits(packed, n))


def test_pack_bits_shapes_and_non_bool():
    m = (torch.rand(6, 11, generator=_gen(1)) > 0.3).to(DEVICE).t()
    _assert_same(K.pack_bits(m), reference.pack_bits(m))
    ints = torch.randint(-300, 300, (77,), generator=_gen(2)).to(DEVICE)
    _assert_same(K.pack_bits(ints), reference.pack_bits(ints))
    packed = K.pack_bits(m)
    _assert_same(K.unpack_bits(packed, 60), reference.unpack_bits(packed, 60))
    with pytest.raises(ValueError):
        K.unpack_bits(packed, 8 * packed.numel() + 1)


# --------------------------------------------------------------------------- dropout
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.3000000001, 1.0])
@pytest.mark.parametrize("shape", [(1,), (3, 333), (2, 4097)], ids=str)
def test_dropout_mask(shape, p):
    like = torch.empty(shape, device=DEVICE)
    _assert_same(K.dropout_mask(like, p, 42), reference.dropout_mask(like, p, 42))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
def test_seeded_dropout(p, dtype):
    for seed, shape in [(0, (1,)), (2**40 + 3, (5, 301))]:
        x = _randn(shape, dtype, seed=1)
        _assert_same(K.seeded_dropout(x, p, seed), reference.seeded_dropout(x, p, seed))
    x = _randn((9, 7), dtype, seed=2).t()
    _assert_same(K.seeded_dropout(x, p, 5), reference.seeded_dropout(x, p, 5))
    _assert_same(K.seeded_dropout(x[:0], p, 5), reference.seeded_dropout(x[:0], p, 5))


def test_dropout_mask_matches_seeded_dropout():
    x = _randn((4, 100), torch.float32)
    keep = K.dropout_mask(x, 0.4, 77)
    y = K.seeded_dropout(x, 0.4, 77)
    assert torch.equal(y != 0, keep & (x != 0))


# ------------------------------------------------------------------ dispatch (CUDA)
@pytest.mark.skipif(DEVICE != "cuda", reason="torch.ops.slimfit dispatches to Triton on CUDA only")
def test_torch_ops_dispatch_on_cuda():
    ops = torch.ops.slimfit
    x = _randn((3, 200), torch.bfloat16)
    _assert_same(ops.quantize(x, 4, 64, True, 3), reference.quantize(x, 4, 64, True, 3))
    _assert_same(ops.topk_prune(x, 17, True), reference.topk_prune(x, 17, True))
    _assert_same(ops.seeded_dropout(x, 0.25, 3), reference.seeded_dropout(x, 0.25, 3))
