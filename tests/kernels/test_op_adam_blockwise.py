"""slimfit::adam_blockwise_ (the held Adam step in one kernel) on the CPU: the C++ kernel bit for bit its reference
(slimfit/kernels/reference_adam.py) over dtypes, roundings, weight decays, block sizes, ragged and empty pieces and
64-bit offsets; the reference itself against torch's AdamW from the decoded moments; its errors."""
import itertools
import math

import pytest
import torch

from slimfit.kernels import backend_info, qmaps, reference, reference_adam

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
native = pytest.mark.skipif(backend_info()["cpu"] != "native (C++)", reason="the C++ extension is not loaded")


def _call(sizes, dtype, grad_dtype, *, block_size=128, stochastic=True, round_weights=True, weight_decay=0.01,
          decoupled=True, offsets=None, seed=0, t=5, bits=8):
    g = torch.Generator().manual_seed(seed)
    qm, qv = qmaps.on_device("signed", bits, torch.zeros(1)), qmaps.on_device("unsigned", bits, torch.zeros(1))
    params = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    grads = [(torch.randn(n, generator=g) * 1e-2).to(grad_dtype) for n in sizes]
    m = [reference.quantize_blockwise(torch.randn(n, generator=g) * 1e-3, qm, block_size, True, 1) for n in sizes]
    v = [reference.quantize_blockwise(torch.rand(n, generator=g) * 1e-2, qv, block_size, True, 2) for n in sizes]
    k, lr = len(sizes), 1e-3
    return [params, grads, [c for c, _ in m], [a for _, a in m], [c for c, _ in v], [a for _, a in v], qm, qv,
            [lr / (1 - 0.9 ** t)] * k, [1 - lr * weight_decay] * k, [math.sqrt(1 - 0.999 ** t)] * k, 0.9, 0.999,
            1e-8, weight_decay, decoupled, block_size, stochastic, list(range(100, 100 + 3 * k)),
            offsets if offsets is not None else [0] * k, round_weights, [], 0]


def _clone(args):
    return [[t.clone() for t in a] if isinstance(a, list) and a and torch.is_tensor(a[0]) else a for a in args]


def _outputs(args):
    return [t for k in (0, 2, 3, 4, 5) for t in args[k]]


@native
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype,grad_dtype", [(F32, F32), (BF16, BF16), (F16, F16), (BF16, F32)],
                         ids=["fp32", "bf16", "fp16", "bf16-fp32grad"])
def test_the_cpu_kernel_is_its_reference_bit_for_bit(dtype, grad_dtype, bits):
    """8- and 4-bit codes (two to a byte; pieces of odd length leave the last byte's high half zero)."""
    for stochastic, round_weights, decoupled, wd, bs in itertools.product(
            [True, False], [True, False], [True, False], [0.0, 0.01], [64, 128]):
        args = _call([300, 1, 5001, 0], dtype, grad_dtype, block_size=bs, stochastic=stochastic,
                     round_weights=round_weights, weight_decay=wd, decoupled=decoupled,
                     offsets=[0, 2**32 - 256, 2**33 + 512, 7], bits=bits)
        got, want = _clone(args), _clone(args)
        torch.ops.slimfit.adam_blockwise_(*got)
        reference_adam.adam_blockwise_(*want)
        for a, b in zip(_outputs(got), _outputs(want)):
            assert torch.equal(a, b), (stochastic, round_weights, decoupled, wd, bs)
        assert not torch.equal(got[0][0], args[0][0])   # the weights moved


@native
@pytest.mark.parametrize("bits", [8, 4])
def test_the_draws_follow_the_global_index_not_the_cut(bits):
    """A piece cut in two at a block boundary, each half given its place in the whole (offsets), is stepped and
    coded exactly as the whole: what makes a sharded parameter's moments independent of the world size."""
    whole = _call([1024], F32, F32, round_weights=True, bits=bits)
    halves = _clone(whole)
    for k in (0, 1, 2, 3, 4, 5):
        t = halves[k][0]
        cut = {1024: 512, 512: 256, 8: 4}[t.numel()]   # elements, 4-bit code bytes, blocks of 128
        halves[k] = [t[:cut], t[cut:]]
    halves[8], halves[9], halves[10] = whole[8] * 2, whole[9] * 2, whole[10] * 2
    halves[18], halves[19] = whole[18] * 2, [0, 512]
    torch.ops.slimfit.adam_blockwise_(*whole)
    torch.ops.slimfit.adam_blockwise_(*halves)
    for k in (0, 2, 3, 4, 5):
        assert torch.equal(torch.cat(halves[k]), whole[k][0])


def test_the_reference_is_adamw_from_the_decoded_moments():
    """One step of torch's AdamW (fp64) from the decoded moments gives the reference's weights to fp32 rounding, and
    its new moments decode within the 8-bit code's error."""
    args = _call([1000], F32, F32, stochastic=False, round_weights=False)
    p0, g = args[0][0].clone(), args[1][0]
    m0 = reference.dequantize_blockwise(args[2][0], args[3][0], args[6], 128, (1000,), torch.float64)
    s0 = reference.dequantize_blockwise(args[4][0], args[5][0], args[7], 128, (1000,), torch.float64)
    reference_adam.adam_blockwise_(*args)
    p = torch.nn.Parameter(p0.double())
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    p.grad = g.double()
    opt.state[p] = {"step": torch.tensor(4.0, dtype=torch.float64), "exp_avg": m0.clone(),
                    "exp_avg_sq": s0 * s0}
    opt.step()
    torch.testing.assert_close(args[0][0].double(), p.detach(), rtol=0, atol=1e-6)
    m1 = reference.dequantize_blockwise(args[2][0], args[3][0], args[6], 128, (1000,), torch.float64)
    s1 = reference.dequantize_blockwise(args[4][0], args[5][0], args[7], 128, (1000,), torch.float64)
    blocks = lambda x: x.view(-1, 125)   # noqa: E731  (not the code's blocks: a tolerance per 125 elements)
    exp_m, exp_s = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"].sqrt()
    # the nearest level: within half the top decade's gap (0.9 / 64 signed, 0.9 / 128 unsigned) of each block's max
    assert ((m1 - exp_m).abs() <= 0.5 * 0.9 / 64 * exp_m.abs().max() + 1e-12).all()
    assert ((s1 - exp_s).abs() <= 0.5 * 0.9 / 128 * exp_s.abs().max() + 1e-12).all()
    assert blocks(m1).shape[0] == 8


@pytest.mark.parametrize("bad,match", [
    (lambda a: a.__setitem__(1, [a[1][0][:-1]]), "grads"),
    (lambda a: a.__setitem__(3, [a[3][0][:-1]]), "block maxima|m_absmax"),
    (lambda a: a.__setitem__(2, [a[2][0].float()]), "codes|m_codes"),
    (lambda a: a.__setitem__(18, a[18][:2]), "seeds"),
    (lambda a: a.__setitem__(16, 100), "block_size"),
    (lambda a: a.__setitem__(0, [a[0][0].to(torch.float64)]), "float32, float16 or bfloat16|dtype"),
    (lambda a: a.__setitem__(0, [a[0][0].view(10, 30).t()]), "contiguous"),
], ids=["grad-size", "absmax-size", "codes-dtype", "seeds", "block-size", "param-dtype", "non-contiguous"])
def test_bad_arguments_are_refused_with_their_names(bad, match):
    args = _call([300], F32, F32)
    bad(args)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        torch.ops.slimfit.adam_blockwise_(*args)
    with pytest.raises((ValueError, TypeError), match=match):
        from slimfit.kernels._ops import _checked
        _checked("adam_blockwise_", reference_adam.adam_blockwise_)(*args)


@native
@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
def test_nan_inf_and_zero_blocks_are_coded_as_the_reference_codes_them(stochastic):
    """A NaN gradient in one block, an inf in another, and an all-zero block (zero moments, zero gradient,
    weight decay off): the C++ kernel's started searches end where the reference's do."""
    args = _call([128 * 4], F32, F32, stochastic=stochastic, round_weights=False, weight_decay=0.0)
    g = args[1][0]
    g[5], g[130] = float("nan"), float("inf")
    g[256:384] = 0.0
    args[2][0][256:384] = reference.quantize_blockwise(torch.zeros(128), args[6], 128)[0]
    args[3][0][2] = 0.0
    args[5][0][2] = 0.0
    got, want = _clone(args), _clone(args)
    torch.ops.slimfit.adam_blockwise_(*got)
    reference_adam.adam_blockwise_(*want)
    for a, b in zip(_outputs(got), _outputs(want)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _scored(args, kind: int, scored=None):
    """args with score sums for the pieces in ``scored`` (all by default) and score kind ``kind``."""
    bs = args[16]
    scored = range(len(args[0])) if scored is None else scored
    args[21] = [torch.full((3, -(-p.numel() // bs)), -1.0) if j in scored else torch.zeros(0)
                for j, p in enumerate(args[0])]
    args[22] = kind
    return args


@native
@pytest.mark.parametrize("kind", [1, 2, 3], ids=["relative", "robust", "absolute"])
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["fp32", "bf16", "fp16"])
def test_the_cpu_kernels_score_sums_are_its_reference_bit_for_bit(kind, dtype):
    """Scored and unscored pieces in one call, zeros and a NaN among the old weights: the C++ kernel's block sums
    are the reference's bits, and scoring changes nothing else the op writes."""
    args = _scored(_call([300, 1, 5000, 130], dtype, dtype, block_size=64, offsets=[0, 5, 2**32 - 256, 9]), kind,
                   scored={0, 1, 2})
    args[0][0][:70] = 0.0                    # a block and a bit of zero weights
    args[0][2][17] = float("nan")
    got, want, plain = _clone(args), _clone(args), _clone(args)
    plain[21], plain[22] = [], 0
    torch.ops.slimfit.adam_blockwise_(*got)
    reference_adam.adam_blockwise_(*want)
    torch.ops.slimfit.adam_blockwise_(*plain)
    for a, b in zip(got[21], want[21]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for a, b in zip(_outputs(got), _outputs(plain)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert got[21][3].numel() == 0 and torch.isnan(got[21][2][:, 0]).any()


@pytest.mark.parametrize("kind,name", [(1, "relative"), (2, "robust"), (3, "absolute")])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_the_score_sums_give_the_schedulers_score_of_the_move(kind, name, dtype):
    """The sums over a piece's blocks give scores.py's score of (weights before, weights as stored after), with
    zero old weights left out of the relative score, to fp32 rounding."""
    from slimfit.scheduler import scores

    args = _scored(_call([1000], dtype, dtype), kind)
    args[0][0][:150] = 0.0
    old = args[0][0].clone()
    reference_adam.adam_blockwise_(*args)
    s = args[21][0].double().sum(1)
    new = args[0][0]
    if name == "relative":
        keep = old != 0
        want = ((new.double() - old.double())[keep] / old.double()[keep]).abs().mean()
        got = s[0] / s[1]
        assert s[1] == keep.sum() and torch.isclose(s[2], (new.double() - old.double()).abs().sum(), rtol=1e-5)
    elif name == "robust":
        want, got = torch.tensor(scores.robust_scores_naive(old.double(), new.double())), s[0].sqrt() / s[1].sqrt()
    else:
        want, got = torch.tensor(scores.absolute_scores_naive(old.double(), new.double())), s[0] / s[1]
    assert torch.isclose(got, want.double(), rtol=1e-5), (got, want)


@pytest.mark.parametrize("bad,match", [
    (lambda a: a.__setitem__(22, 4), "score must be"),
    (lambda a: a.__setitem__(21, []), "score_sums"),
    (lambda a: a.__setitem__(21, [torch.zeros(3, 2)]), r"score_sums\[0\]"),
    (lambda a: a.__setitem__(21, [torch.zeros(3, 3, dtype=torch.float64)]), r"score_sums\[0\]"),
], ids=["kind", "missing", "shape", "dtype"])
def test_bad_score_arguments_are_refused_with_their_names(bad, match):
    args = _scored(_call([300], F32, F32), 1)
    bad(args)
    with pytest.raises((ValueError, RuntimeError), match=match):
        torch.ops.slimfit.adam_blockwise_(*args)
    with pytest.raises(ValueError, match=match):
        from slimfit.kernels._ops import _checked
        _checked("adam_blockwise_", reference_adam.adam_blockwise_)(*args)
