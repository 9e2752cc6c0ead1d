"""What only the Triton kernels have: launcher signatures, the device-side generator, launch and tile
configurations (several programs, the EVEN / IDX64 variants, chunked top-k rows, restore programs),
and the launchers' own behaviour outside the op checks. The ops themselves, on every backend:
test_op_*.py. On CUDA the kernels run on the GPU; without it, on CPU tensors under TRITON_INTERPRET=1
(marked `triton_interpret`; small shapes and smaller programs: the interpreter pays per operation).
"""
import importlib
import inspect

import pytest
import torch
from _backends import INTERPRET, OPS, assert_same, check, gen, make_backend, randn, ties

from slimfit.kernels import reference, rng

if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set", allow_module_level=True)
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
try:
    import slimfit.kernels.triton as T
    from slimfit.kernels.triton import _rng
    from slimfit.kernels.triton import topk as topk_mod
except Exception as exc:  # pragma: no cover - a triton too old for the kernels
    pytest.skip(f"slimfit Triton kernels not importable: {exc}", allow_module_level=True)

pytestmark = [pytest.mark.triton_interpret] if INTERPRET else []
DEVICE = "cpu" if INTERPRET else "cuda"
qmod = importlib.import_module("slimfit.kernels.triton.quantize")


@pytest.fixture
def backend():
    return make_backend("triton")


@pytest.fixture
def small_programs(monkeypatch):
    """In the interpreter, quantize programs of 1024 elements instead of 4096 (the same kernel with
    fewer groups per program), so that a few thousand elements make several programs."""
    if INTERPRET:
        monkeypatch.setattr(qmod, "BLOCK_ELEMS", 1024)
    return qmod.BLOCK_ELEMS


@pytest.mark.parametrize("op", OPS)
def test_launcher_signature_matches_reference(op):
    def params(f):
        return list(inspect.signature(f).parameters)

    assert params(getattr(T, op)) == params(getattr(reference, op))


# ------------------------------------------------------------------------------ rng
@triton.jit(do_not_specialize=["k0", "k1"])
def _words_kernel(idx_ptr, out_ptr, n, k0, k1, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    idx = tl.load(idx_ptr + offs, mask=offs < n, other=0)
    w = _rng.random_words(idx, k0, k1)
    tl.store(out_ptr + offs, w.to(tl.int64), mask=offs < n)


def _words(idx, seed):
    k0, k1 = rng.seed_keys(seed)
    return rng.lowbias32(rng.lowbias32((idx & rng.MASK32) ^ k0) ^ (idx >> 32) ^ k1)


@pytest.mark.parametrize("seed", [0, 1, 2**31, 2**32 + 5, 2**63 - 1])
def test_rng_words_match_reference_including_high_indices(seed):
    idx = torch.tensor([0, 1, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 3, 2**40 + 12345,
                        2**62 + 99], dtype=torch.int64, device=DEVICE)
    out = torch.empty_like(idx)
    _words_kernel[(1,)](idx, out, idx.numel(), *_rng.seed_key_args(seed), BLOCK=16)
    assert_same(out, _words(idx.cpu(), seed))


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
    out = torch.empty(64, dtype=torch.float32, device=DEVICE)
    base_t = torch.tensor([base], dtype=torch.int64, device=DEVICE)
    _hoisted_uniform_kernel[(1,)](base_t, out, *_rng.seed_key_args(7), BLOCK=64)
    idx = torch.arange(base, base + 64, dtype=torch.int64)
    assert_same(out, (_words(idx, 7) >> 8).to(torch.float32) * rng.INV_2_24)


# ------------------------------------------------------------------------- quantize
@pytest.mark.parametrize("group_size", [64, 128])
def test_quantize_several_programs(backend, small_programs, group_size):
    # 2 full programs and a partial one
    x = randn((2 * small_programs + 77,), seed=3, device=DEVICE)
    assert -(-x.numel() // group_size) > qmod.launch_config(group_size, 10**6).groups * 2
    got, _ = check(backend, "quantize", x, 4, group_size, True, 1234)
    check(backend, "dequantize", *got, 4, group_size, list(x.shape), torch.float32)


def _launch_quantize(x, bits, group_size, stochastic, seed, even, idx64):
    """The quantize kernel with its EVEN / IDX64 variants forced (the launcher picks them by size)."""
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
def test_quantize_even_and_int64_variants(small_programs, stochastic, idx64):
    """EVEN (no masks) and IDX64 (int64 program base) are chosen by tensor size; forced here on
    small tensors (two programs, full or with a partial one), each must give the reference's bits."""
    bits = 2 if stochastic else 8
    for n, even in ((2 * small_programs, True), (2 * small_programs + 77, False)):
        x = randn((n,), seed=n, device=DEVICE)
        got = _launch_quantize(x, bits, 128, stochastic, 99, even, idx64)
        assert_same(got, reference.quantize(x.cpu(), bits, 128, stochastic, 99))


# ----------------------------------------------------------------------------- top-k
def test_topk_chunked_rows(backend, monkeypatch):
    # Force several chunks on a short row (a partial last chunk, and an exact fit: EVEN).
    monkeypatch.setattr(topk_mod, "REGISTER_ROW_MAX", 64)
    monkeypatch.setattr(topk_mod, "CHUNK", 64)
    for row in (150, 128):
        cfg = topk_mod.tile_config(row)
        assert (cfg.block, cfg.n_chunks) == (64, triton.cdiv(row, 64))
        x = ties((2, row), seed=11, device=DEVICE)
        for k, by_magnitude in ((61, True), (row, False), (1, False)):
            got, _ = check(backend, "topk_prune", x, k, by_magnitude, bitwise=True)
            check(backend, "topk_restore", *got, row, bitwise=True)


@pytest.mark.parametrize("row, chunks", [(197, [256]), (768, [256] * 3), (2048, [2048]), (3000, [1024] * 3),
                                         (8192, [8192]), (8193, [4096] * 3), (65536, [4096] * 16), (7, [16])])
def test_topk_tile_config_pads_no_row_to_a_power_of_two(row, chunks):
    cfg = topk_mod.tile_config(row, 1000)
    assert [cfg.block] * cfg.n_chunks == chunks
    assert cfg.num_warps == max(1, min(16, cfg.block // 256))
    assert cfg.constexprs(True)["EVEN"] == (row == cfg.block * cfg.n_chunks)


@pytest.mark.parametrize("row, k, n_rows", [(197, 19, 45), (768, 76, 7), (3, 3, 1500), (5000, 500, 2), (10, 20, 3)])
def test_topk_restore_programs(row, k, n_rows):
    """Several rows per program (and a partial last program), one long row in chunks (the values:
    test_op_topk.py); more kept entries than the row is long: the launcher drops indices beyond it."""
    cfg = topk_mod.restore_config(row, k, n_rows)
    assert cfg.rows * max(row, k) <= max(topk_mod.RESTORE_BLOCK, max(row, k))
    if k > row:
        values = torch.randn(n_rows, k, generator=gen(row)).to(DEVICE)
        idx = torch.arange(k).repeat(n_rows, 1).to(torch.int16).to(DEVICE)   # 0..k-1: k - row dropped
        assert_same(T.topk_restore(values, idx, row), values[:, :row].cpu())


def test_topk_restore_writes_every_element(backend, monkeypatch):
    # The kernel writes zeros itself: the output buffer may hold anything before.
    new_empty = torch.Tensor.new_empty

    def poisoned(self, *args, **kwargs):
        t = new_empty(self, *args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned)
    got, _ = check(backend, "topk_prune", ties((6, 197), seed=3, device=DEVICE), 20, True)
    check(backend, "topk_restore", *got, 197)


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


# ------------------------------------------------- the launchers outside the op checks
def test_launchers_own_checks_and_inputs():
    """The launchers called directly (not through _ops' checks): pack_bits of any dtype (x != 0),
    their own errors."""
    ints = torch.randint(-300, 300, (77,), generator=gen(2)).to(DEVICE)
    assert_same(T.pack_bits(ints), reference.pack_bits(ints.cpu()))
    packed = T.pack_bits(ints != 0)
    with pytest.raises(ValueError):
        T.unpack_bits(packed, 8 * packed.numel() + 1)
    v = torch.randn(3, 2, device=DEVICE)
    with pytest.raises(ValueError, match="row_length is 0"):
        T.topk_restore(v, torch.zeros(3, 2, dtype=torch.int16, device=DEVICE), 0)
