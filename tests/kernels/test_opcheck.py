"""torch.library.opcheck on every registered op (slimfit/kernels/_ops.py), through the dispatcher:
on CPU (the C++ kernels, or the reference with SLIMFIT_BACKEND=reference) and on CUDA (the extension's
kernels or Triton; marked `gpu`). One table of sample arguments; a new op adds its rows here."""
import itertools

import pytest
import torch
from _backends import FLOATS, OPS, gen, randn

from slimfit.kernels import reference


def _table():
    x = randn((3, 77))
    xh = randn((2, 40), torch.bfloat16)
    rows = [
        ("quantize", (xh, 2, 32, False, 0)),
        ("topk_prune", (randn((4, 50)), 5, True)),
        ("topk_prune", (x, 8, False)),
        ("topk_restore", (*reference.topk_prune(x, 8, True), 77)),
        ("pack_bits", (torch.rand(3, 11, generator=gen(1)) > 0.5,)),
        ("unpack_bits", (torch.randint(0, 255, (5,), dtype=torch.uint8, generator=gen(2)), 37)),
        ("dropout_mask", (x, 0.2, 3)),
        ("seeded_dropout", (xh, 0.2, 3)),
        ("seeded_dropout", (randn((6, 7)), 0.25, 3)),
        ("round_stochastic", (x, torch.bfloat16, 3)),
        ("round_stochastic", (randn((2, 3, 5)), torch.float16, 2**40 + 5)),
    ]
    # every dtype with every shape, both argument sets; every output dtype
    for dtype, shape in itertools.product(FLOATS, [(3, 77), (1,), (2, 3, 5)]):
        rows += [
            ("quantize", (randn(shape, dtype, seed=1), 4, 32, True, 5)),
            ("quantize", (randn(shape, dtype, seed=1), 8, 128, False, 0)),
            ("dequantize", (*reference.quantize(randn(shape, seed=2), 4, 64, False, 0), 4, 64, list(shape), dtype)),
        ]
    from slimfit.kernels import qmaps

    for kind, bits, shape, dtype in (("signed", 8, (3, 77), torch.float32), ("signed", 4, (1,), torch.bfloat16),
                                     ("unsigned", 4, (2, 3, 5), torch.float16), ("unsigned", 8, (300,), torch.float32)):
        x = randn(shape, dtype, seed=3).abs() if kind == "unsigned" else randn(shape, dtype, seed=3)
        q = qmaps.MAPS[kind](bits)
        rows += [
            ("quantize_blockwise", (x, q, 32)),
            ("quantize_blockwise", (x, q, 64, True, 2**40 + 5)),
            ("dequantize_blockwise", (*reference.quantize_blockwise(x, q, 64), q, 64, list(shape), dtype)),
        ]
    rows.append(("adam_blockwise_", _adam_blockwise_args()))
    return rows


def _adam_blockwise_args():
    """Two pieces (fp32, bf16 with an fp32 gradient) of the held Adam step, moments coded as the held step codes
    them, the first scored (relative)."""
    from slimfit.kernels import qmaps

    qm, qv = qmaps.MAPS["signed"](8), qmaps.MAPS["unsigned"](8)
    sizes = (300, 77)
    m = [reference.quantize_blockwise(randn((n,), seed=10 + n) * 1e-3, qm, 64, True, 1) for n in sizes]
    v = [reference.quantize_blockwise(randn((n,), seed=20 + n).abs() * 1e-2, qv, 64, True, 2) for n in sizes]
    return ([randn((300,), seed=4), randn((77,), torch.bfloat16, seed=5)],
            [randn((300,), seed=6), randn((77,), seed=7)],
            [c for c, _ in m], [a for _, a in m], [c for c, _ in v], [a for _, a in v], qm, qv, [1e-3, 2e-3],
            [0.999, 0.998], [0.03, 0.04], 0.9, 0.999, 1e-8, 0.01, True, 64, True, [1, 2, 3, 4, 5, 6], [0, 2**33],
            True, [torch.zeros(3, 5), torch.zeros(0)], 1)


TABLE = _table()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _args_id(args):
    return "-".join(f"{a.dtype}{list(a.shape)}".replace("torch.", "") if isinstance(a, torch.Tensor) else str(a)
                    for a in args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,args", TABLE, ids=[f"{n}-{_args_id(a)}" for n, a in TABLE])
def test_opcheck(name, args, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(getattr(torch.ops.slimfit, name).default, args)


def test_every_op_is_in_the_table():
    assert {name for name, _ in TABLE} == set(OPS)
