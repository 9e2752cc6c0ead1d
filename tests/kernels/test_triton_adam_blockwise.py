"""The Triton launcher of slimfit::adam_blockwise_ against its reference (reference_adam.adam_blockwise_), bit for
bit: weights, codes and block maxima after one step from the same inputs. On CUDA the kernel runs on the GPU;
without it, on CPU tensors under TRITON_INTERPRET=1 (small pieces: the interpreter pays per operation).
"""
import inspect
import math

import pytest
import torch
from _backends import INTERPRET

from slimfit.kernels import qmaps, reference, reference_adam, rng

if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set", allow_module_level=True)
triton = pytest.importorskip("triton")
try:
    import slimfit.kernels.triton as T
    from slimfit.kernels.triton import adam_blockwise as adam_mod
except Exception as exc:  # pragma: no cover - a triton too old for the kernels
    pytest.skip(f"slimfit Triton kernels not importable: {exc}", allow_module_level=True)

pytestmark = [pytest.mark.triton_interpret] if INTERPRET else []
DEVICE = "cpu" if INTERPRET else "cuda"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
BETA1, BETA2, EPS, LR = 0.9, 0.999, 1e-8, 1e-3
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
             torch.uint8: torch.uint8}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _spread(n: int, scale: float, g: torch.Generator) -> torch.Tensor:
    """Normal values whose magnitudes span three decades, as moments do inside a block."""
    return torch.randn(n, generator=g) * scale * 10.0 ** -(3 * torch.rand(n, generator=g))


def _piece(n, dtype, grad_dtype, block_size, seed, bits=8):
    """(param, grad, m_codes, m_absmax, v_codes, v_absmax) of one piece of n elements, the moments encoded as
    the held step encodes them (stochastic codes of m, and of sqrt(v))."""
    g = _gen(seed)
    param = (torch.randn(n, generator=g) * 0.5).to(dtype)
    grad = (torch.randn(n, generator=g) * 0.01).to(grad_dtype)
    m = _spread(n, 1e-2, g)
    v = _spread(n, 1e-2, g) ** 2
    m_codes, m_absmax = reference.quantize_blockwise(m, qmaps.on_device("signed", bits, m), block_size, True, seed)
    v_codes, v_absmax = reference.quantize_blockwise(v.sqrt(), qmaps.on_device("unsigned", bits, v), block_size,
                                                     True, seed + 1)
    return [t.to(DEVICE) for t in (param, grad, m_codes, m_absmax, v_codes, v_absmax)]


def _call(sizes, dtype=F32, grad_dtype=None, block_size=128, stochastic=False, round_weights=False,
          decoupled=True, weight_decay=0.0, offsets=None, seed=0, pieces=None, bits=8):
    """Inputs of one call (a piece per size), step t = 3 + j for piece j, as the held step passes them."""
    pieces = pieces or [_piece(n, dtype, grad_dtype or dtype, block_size, seed + 10 * j, bits)
                        for j, n in enumerate(sizes)]
    steps = [3 + j for j in range(len(pieces))]
    cols = [list(c) for c in zip(*pieces)]
    return (*cols, qmaps.on_device("signed", bits, cols[0][0]), qmaps.on_device("unsigned", bits, cols[0][0]),
            [LR / (1 - BETA1 ** t) for t in steps], [1 - LR * weight_decay for _ in steps],
            [math.sqrt(1 - BETA2 ** t) for t in steps], BETA1, BETA2, EPS, weight_decay, decoupled, block_size,
            stochastic, [seed + 1000 + k * (2**40 + 7) for k in range(3 * len(pieces))],
            list(offsets) if offsets is not None else [0] * len(pieces), round_weights)


def _same_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy of t at the same storage offset and strides in a storage of its size (its address as unaligned)."""
    storage = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device=t.device)
    out = storage.as_strided(t.shape, t.stride(), t.storage_offset())
    return out.copy_(t)


def _clone(args, keep_layout=False):
    copy = _same_layout if keep_layout else torch.clone
    return tuple([copy(t) for t in a] if isinstance(a, list) and a and torch.is_tensor(a[0]) else a for a in args)


def _assert_bits(got, want, what):
    """Equal bits (any NaN equal to any NaN: a payload is not the op's)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if got.is_floating_point():
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), f"{what}: NaN positions differ"
        got, want = got[~nan], want[~nan]
    iv = _INT_VIEW[got.dtype]
    bad = (got.view(iv) != want.view(iv)).nonzero().flatten()
    assert bad.numel() == 0, f"{what}: {bad.numel()} elements differ, first at {bad[:5].tolist()}: " \
                             f"{got[bad[:5]].tolist()} vs {want[bad[:5]].tolist()}"


def check(args, keep_layout=False):
    """Run the launcher on clones of args and the reference on CPU copies (on a GPU torch divides by a host
    scalar through its reciprocal, which the definition does not); every in-place output bit for bit equal.
    keep_layout: the launcher's clones at the tensors' storage offsets and strides (odd addresses stay odd)."""
    got = _clone(args, keep_layout)
    want = tuple([t.cpu().clone() for t in a] if isinstance(a, list) and a and torch.is_tensor(a[0])
                 else a.cpu() if torch.is_tensor(a) else a for a in args)
    T.adam_blockwise_(*got)
    reference_adam.adam_blockwise_(*want)
    for k, name in enumerate(("params", "grads", "m_codes", "m_absmax", "v_codes", "v_absmax")):
        for j, (a, b) in enumerate(zip(got[k], want[k])):
            _assert_bits(a.cpu(), b, f"{name}[{j}]")
    return got, want


SIZES = [1, 130, 300, 1000]


def test_launcher_signature_matches_reference():
    def names(f):
        return list(inspect.signature(f).parameters)

    assert names(T.adam_blockwise_) == names(reference_adam.adam_blockwise_)
    assert "adam_blockwise_" in T.__all__


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("round_weights", [False, True], ids=["cast", "round"])
@pytest.mark.parametrize("dtype,grad_dtype", [(F32, F32), (BF16, BF16), (F16, F16), (BF16, F32), (F16, BF16)],
                         ids=["fp32", "bf16", "fp16", "bf16-fp32grad", "fp16-bf16grad"])
def test_matches_reference(dtype, grad_dtype, round_weights, stochastic):
    args = _call([130, 1000], dtype, grad_dtype, stochastic=stochastic, round_weights=round_weights,
                 weight_decay=0.01, offsets=[0, 4096], seed=1)
    got, _ = check(args)
    # not vacuous: the weights moved and the codes changed
    assert not torch.equal(got[0][1], args[0][1])
    assert not torch.equal(got[2][1], args[2][1])


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_weight_decay(dtype, weight_decay, decoupled):
    check(_call([300], dtype, decoupled=decoupled, weight_decay=weight_decay, stochastic=True, round_weights=True,
                seed=2))


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("block_size", [64, 128, 256])
def test_block_sizes_and_ragged_pieces(block_size, stochastic):
    """Several pieces in one call, none a multiple of the block size (a last block padded with zeros)."""
    check(_call(SIZES, F32, block_size=block_size, stochastic=stochastic, weight_decay=0.01,
                offsets=[0, 7, 1000, 5000], seed=3))


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_large_offsets(dtype):
    """Random index offsets[j] + i as a 64-bit index: a piece straddling 2**32 and one above 2**33."""
    args = _call([1000, 300, 130], dtype, stochastic=True, round_weights=True, weight_decay=0.01,
                 offsets=[2**32 - 256, 2**33 + 512, 2**40 + 3], seed=4)
    check(args)


def test_offsets_move_the_draws():
    """The same piece at another offset draws other uniforms (the offset reaches the hash)."""
    a = _call([1000], BF16, stochastic=True, round_weights=True, offsets=[0], seed=5)
    b = _call([1000], BF16, stochastic=True, round_weights=True, offsets=[2**32 - 256], seed=5)
    ga, _ = check(a)
    gb, _ = check(b)
    assert not torch.equal(ga[2][0], gb[2][0])


def test_empty_pieces():
    check(_call([0, 300, 0, 1], BF16, stochastic=True, round_weights=True, offsets=[0, 0, 300, 300], seed=6))
    empty = _call([0], F32, seed=7)
    got, _ = check(empty)
    assert got[0][0].numel() == 0


def test_several_programs(monkeypatch):
    """Programs of 2 blocks of 64 (the same kernel, smaller tiles): many programs, a ragged last one."""
    monkeypatch.setattr(adam_mod, "TILE_ELEMS", 128)
    assert adam_mod.blocks_per_program(64, 100) == 2
    check(_call([1000, 130], BF16, block_size=64, stochastic=True, round_weights=True, weight_decay=0.01,
                offsets=[2**32 - 300, 17], seed=8))
    check(_call([1000], F32, block_size=64, decoupled=False, weight_decay=0.01, seed=9))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the interpreter's numpy
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_nonfinite_and_zero_blocks(stochastic):
    """A NaN and an inf gradient (their blocks' maxima NaN / inf), a block of zero moments and gradients, a
    subnormal block maximum: codes and maxima as the reference makes them."""
    n, bs = 512, 128
    param, grad, mc, ma, vc, va = _piece(n, F32, F32, bs, seed=10)
    grad[5] = float("nan")
    grad[200] = float("inf")
    zero = slice(256, 384)
    grad[zero] = 0.0
    for codes, absmax, kind in ((mc, ma, "signed"), (vc, va, "unsigned")):
        codes[zero] = qmaps.code_of_zero(kind, 8)
        absmax[2] = 0.0
    ma[3] = 1e-39          # subnormal: decodes to tiny values, the new maximum is the gradient's
    check(_call(None, F32, block_size=bs, stochastic=stochastic, weight_decay=0.01,
                pieces=[[param, grad, mc, ma, vc, va]], seed=10))


class _CountingKernel:
    """Stands in for the launcher's jit kernel: records each launch (its grid and keyword arguments) and runs it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.launches.append((grid, kwargs))
            return launch(*args, **kwargs)

        return run


@pytest.fixture
def launches(monkeypatch):
    counting = _CountingKernel(adam_mod._adam_blockwise_kernel)
    monkeypatch.setattr(adam_mod, "_adam_blockwise_kernel", counting)
    return counting.launches


def _mixed_pieces(kinds, block_size, seed):
    """A piece per (size, weight dtype, gradient dtype)."""
    return [_piece(n, dt, gdt, block_size, seed + 10 * j) for j, (n, dt, gdt) in enumerate(kinds)]


def _unaligned(piece, shift: int):
    """The piece's tensors copied into larger buffers at `shift` elements in: a bf16 weight at an odd element, the
    codes at an odd byte, the maxima at an odd block (as slices of a parameter and its entries may start)."""
    out = []
    for t in piece:
        buf = torch.zeros(t.numel() + shift, dtype=t.dtype, device=t.device)
        buf[shift:].copy_(t)
        out.append(buf[shift:])
    return out


def test_one_launch_per_dtype_group(launches):
    """A call's non-empty pieces go to one launch per (weight dtype, gradient dtype), however many pieces."""
    kinds = [(130, F32, F32), (0, BF16, BF16), (7, BF16, BF16), (300, F32, F32), (64, BF16, F32), (1, F16, BF16),
             (0, F16, F16), (129, BF16, BF16), (33, BF16, F32), (2, F32, F32)]
    args = _call(None, block_size=64, stochastic=True, round_weights=True, weight_decay=0.01,
                 offsets=[2**32 - 64 * j for j in range(len(kinds))], seed=20, pieces=_mixed_pieces(kinds, 64, 20))
    check(args)
    groups = {(dt, gdt) for n, dt, gdt in kinds if n}
    assert len(launches) == len(groups) == 4
    kinds_launched = {(kw["W_KIND"], kw["G_KIND"]) for _, kw in launches}
    assert kinds_launched == {(adam_mod._W_KINDS[dt], adam_mod._W_KINDS[gdt]) for dt, gdt in groups}
    # the bf16 group's tile is its largest piece's (129 elements: 3 blocks of 64 -> 4 a program), one program each
    (grid, kw), = [(g, kw) for g, kw in launches if (kw["W_KIND"], kw["G_KIND"]) == (adam_mod.W_BF16,) * 2]
    assert kw["BLOCKS"] == 4 and grid == (2,)


def test_one_launch_for_many_pieces(launches):
    check(_call([5, 17, 64, 200, 1, 300], BF16, block_size=64, stochastic=True, round_weights=True, seed=21,
                offsets=[0, 5, 22, 86, 286, 287]))
    assert len(launches) == 1


def test_no_launch_without_elements(launches):
    check(_call([0, 0], BF16, seed=22))
    assert launches == []


def test_many_small_pieces_mixed(launches):
    """40 pieces of 1 to 300 elements, fp32 and bf16 weights and gradients mixed, at large offsets (some
    straddling 2**32), one gradient a non-contiguous view, stochastic codes and rounded weights: bit for bit."""
    g = _gen(23)
    dtypes = [(F32, F32), (BF16, BF16), (BF16, F32), (F32, BF16)]
    kinds = [(int(torch.randint(1, 301, (), generator=g)), *dtypes[int(torch.randint(0, 4, (), generator=g))])
             for _ in range(40)]
    kinds[0] = (300, F32, F32)
    kinds[1] = (1, BF16, BF16)
    pieces = _mixed_pieces(kinds, 128, 23)
    strided = pieces[5][1].new_zeros(pieces[5][1].numel(), 2)
    strided[:, 0] = pieces[5][1]
    pieces[5][1] = strided[:, 0]                  # a gradient of stride 2
    assert not pieces[5][1].is_contiguous()
    offsets = [int(torch.randint(0, 2**40, (), generator=g)) for _ in kinds]
    offsets[2:6] = [2**32 - 1, 2**32 - 150, 2**33 - 7, 2**63 - 2**20]
    args = _call(None, block_size=128, stochastic=True, round_weights=True, weight_decay=0.01, offsets=offsets,
                 seed=23, pieces=pieces)
    check(args, keep_layout=True)
    assert len(launches) == len({(dt, gdt) for _, dt, gdt in kinds}) == 4


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_unaligned_addresses(launches, stochastic):
    """Pieces whose weight, gradient, codes and maxima start at odd elements (bytes, blocks) of their buffers:
    the addresses are the tensors' own; the launch assumes no alignment (ALIGN_ANY, 4 elements a thread)."""
    kinds = [(300, BF16, BF16), (129, BF16, BF16), (64, BF16, BF16)]
    pieces = [_unaligned(p, shift) for p, shift in zip(_mixed_pieces(kinds, 64, 24), (1, 3, 0))]
    assert pieces[0][0].data_ptr() % 4 == 2 and pieces[0][2].data_ptr() % 2 == 1
    check(_call(None, block_size=64, stochastic=stochastic, round_weights=True, weight_decay=0.01,
                offsets=[2**32 - 100, 7, 2**35], seed=24, pieces=pieces), keep_layout=True)
    (grid, kw), = launches
    assert kw["ALIGN"] == adam_mod.ALIGN_ANY
    assert kw["num_warps"] == adam_mod.num_warps(kw["BLOCKS"] * kw["BLOCK_SIZE"], adam_mod.ALIGN_ANY)


def test_align_levels(launches):
    """What a launch assumes is what every piece of its group allows: 16-byte aligned weights, gradients and
    codes with counts multiples of 16 (ALIGN_ALL), a ragged count (ALIGN_PTRS), an odd address (ALIGN_ANY)."""
    for sizes, shift, want in (([256, 64], 0, adam_mod.ALIGN_ALL), ([256, 65], 0, adam_mod.ALIGN_PTRS),
                               ([256, 64], 8, adam_mod.ALIGN_ANY)):
        pieces = [_piece(n, F32, F32, 64, 25 + j) for j, n in enumerate(sizes)]
        pieces[1] = _unaligned(pieces[1], shift) if shift else pieces[1]
        launches.clear()
        check(_call(None, block_size=64, weight_decay=0.01, seed=25, pieces=pieces), keep_layout=True)
        (_, kw), = launches
        assert kw["ALIGN"] == want, (sizes, shift)


def test_table_entries():
    """The host's packing of rows: fp32 bits of the scalars (rounded as the reference's f32), both seed keys of
    rng.seed_keys in one entry; and a group's work list."""
    values = [1.0, -2.0, 1e39, -1e39, 3.4028235677973366e38, 1e-45, 7e-46, 1e-40, 0.1, 1 / 3, 2.0**-149 * 1.5]
    bits = adam_mod._f32_bits(values)
    for x, b in zip(values, bits.tolist()):
        assert b == torch.tensor([reference_adam.f32(x)], dtype=torch.float32).view(torch.int32).item(), x
    seeds = [0, 1, 2**31, 2**32 + 5, 2**40 + 7, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63), 12345678901234]
    for seed, e in zip(seeds, adam_mod._key_pairs(seeds).tolist()):
        k0, k1 = rng.seed_keys(seed)
        assert (e & 0xFFFFFFFF, (e >> 32) & 0xFFFFFFFF) == (k0, k1), seed
    assert adam_mod._work([3, 0, 5], [2, 1, 3], 4).reshape(-1, 2).tolist() == \
        [[3, 0], [3, 4], [0, 0], [5, 0], [5, 4], [5, 8]]


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_adjacent_pieces_of_one_parameter(launches, monkeypatch, dtype):
    """Pieces cut at block boundaries of one parameter and its entries (as the held step cuts them), listed out of
    order, in programs of 2 blocks: the whole buffers after the call equal the reference's, so no program writes a
    weight, code or block maximum of a neighbour (a tile's blocks past its piece's end are masked)."""
    monkeypatch.setattr(adam_mod, "TILE_ELEMS", 64)        # programs of 2 blocks of 32
    bs, cuts = 32, [0, 32, 96, 224, 256, 301]                 # 1, 2, 4, 1 and 2 blocks
    whole = _piece(cuts[-1], dtype, dtype, bs, seed=26)
    pieces = [[t[a:e] if k != 3 and k != 5 else t[a // bs:-(-e // bs)] for k, t in enumerate(whole)]
              for a, e in zip(cuts, cuts[1:])]
    order = [4, 2, 0, 3, 1]     # piece 3 (one block) runs after piece 4, the block past its end is piece 4's first
    args = _call(None, block_size=bs, stochastic=True, round_weights=True, weight_decay=0.01, seed=26,
                 offsets=[2**32 - 128 + cuts[j] for j in order], pieces=[pieces[j] for j in order])
    want = [t.cpu().clone() for t in whole]
    want_pieces = [[t[a:e] if k != 3 and k != 5 else t[a // bs:-(-e // bs)] for k, t in enumerate(want)]
                   for a, e in zip(cuts, cuts[1:])]
    ref_args = list(args)
    for k in range(6):
        ref_args[k] = [want_pieces[j][k] for j in order]
    T.adam_blockwise_(*args)
    reference_adam.adam_blockwise_(*ref_args)
    for name, got, exp in zip(("param", "grad", "m_codes", "m_absmax", "v_codes", "v_absmax"), whole, want):
        _assert_bits(got.cpu(), exp, name)
    (grid, kw), = launches
    assert kw["BLOCKS"] == 2 and grid == (6,)


@pytest.mark.parametrize("kind", [1, 2, 3], ids=["relative", "robust", "absolute"])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_score_sums_match_reference(dtype, kind):
    """Scored and unscored pieces in one call (zeros and a NaN among the old weights, a ragged last block): the
    block sums are the reference's bits (both sum each block by halving), and the rest of the op is unchanged."""
    args = list(_call([300, 130, 64], dtype, stochastic=True, round_weights=True, weight_decay=0.01, seed=40))
    args[0][0][:70] = 0.0
    args[0][1][3] = float("nan")
    sums = [torch.full((3, -(-p.numel() // 128)), -1.0, device=DEVICE) for p in args[0][:2]]
    args += [sums + [torch.zeros(0, device=DEVICE)], kind]
    got, want = check(tuple(args))
    for j in range(3):
        _assert_bits(got[21][j].cpu().view(-1), want[21][j].view(-1), f"score_sums[{j}]")
    assert torch.isnan(want[21][1]).any() and (want[21][0][1] >= 0).all()


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_four_bit_codes_match_reference(dtype, stochastic):
    """4-bit codes (16 levels, two to a byte, the low half first): pieces of odd length (the last byte's high half
    stays zero), blocks of 64 and 128, scored too, bit for bit."""
    for bs in (64, 128):
        args = list(_call([301, 130, 1, 64], dtype, block_size=bs, stochastic=stochastic, round_weights=True,
                          weight_decay=0.01, offsets=[0, 2**32 - 64, 7, 9], seed=50, bits=4))
        args += [[torch.full((3, -(-p.numel() // bs)), -1.0, device=DEVICE) for p in args[0]], 1]
        got, want = check(tuple(args))
        for j in range(4):
            _assert_bits(got[21][j].cpu().view(-1), want[21][j].view(-1), f"score_sums[{j}]")
        assert int(want[2][0][-1]) >> 4 == 0 and int(want[4][0][-1]) >> 4 == 0
