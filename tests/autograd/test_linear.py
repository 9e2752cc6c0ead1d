"""slimfit.autograd.linear against F.linear: exact forward, frozen path bit-exact, quantized
weight gradients within error bounds derived from the format, bytes saved as the format says."""
import math

import pytest
import torch
import torch.nn.functional as F
from _grad_utils import (  # noqa: F401  (single_thread: autouse fixture)
    bert_like_hidden,
    cos_sim,
    nonfinite_missed,
    q_bytes,
    quant_rel_err_theory,
    rel_err,
    saved,
    single_thread,
)
from torch.utils._python_dispatch import TorchDispatchMode

from slimfit.autograd import gelu, linear
from slimfit.memory import measure

IN, OUT = 64, 48


def _param(*shape, trainable=True, scale=0.1):
    return torch.nn.Parameter(torch.randn(*shape) * scale, requires_grad=trainable)


def _inputs(shape, noncontig=False):
    if noncontig and len(shape) >= 2 and shape[-2] > 1:
        # same logical shape, transposed storage (column-major rows)
        x = torch.randn(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
        assert not x.is_contiguous()
    elif noncontig:
        x = torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]  # every other column
        assert not x.is_contiguous() or x.numel() == 0
    else:
        x = torch.randn(*shape)
    return x.requires_grad_()


def _grads(y, inputs, g):
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    return torch.autograd.grad(y, wanted, g)


SHAPES = [(1, IN), (5, IN), (3, 7, IN), (2, 3, 5, IN), (0, IN), (IN,)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("noncontig", [False, True])
def test_frozen_path_bit_exact(shape, bias, noncontig):
    x = _inputs(shape, noncontig)
    w = _param(OUT, IN, trainable=False)
    b = _param(OUT) if bias else None
    y = linear(x, w, b)
    y_ref = F.linear(x, w, b)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y_ref)
    for got, ref in zip(_grads(y, [x, b], g), _grads(y_ref, [x, b], g)):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("noncontig", [False, True])
def test_frozen_path_bit_exact_half(dtype, noncontig):
    x = _inputs((6, 9, IN), noncontig).detach().to(dtype).requires_grad_()
    w = torch.nn.Parameter(torch.randn(OUT, IN, dtype=dtype) * 0.1, requires_grad=False)
    b = torch.nn.Parameter(torch.randn(OUT, dtype=dtype))
    y, y_ref = linear(x, w, b), F.linear(x, w, b)
    assert y.dtype == dtype and torch.equal(y, y_ref)
    g = torch.randn_like(y)
    for got, ref in zip(_grads(y, [x, b], g), _grads(y_ref, [x, b], g)):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("shape", [(5, IN), (3, 7, IN)])
@pytest.mark.parametrize("bias", [True, False])
def test_trainable_full_matches_pytorch(shape, bias):
    x = _inputs(shape)
    w, b = _param(OUT, IN), (_param(OUT) if bias else None)
    y, y_ref = linear(x, w, b), F.linear(x, w, b)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    for got, ref in zip(_grads(y, [x, w, b], g), _grads(y_ref, [x, w, b], g)):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def _ffn_grads(x, w, b, input_bits, stochastic=False):
    """A realistic gradient: FFN up-projection + GELU regressed onto a slightly different
    teacher, so upstream gradients are coherent across tokens as in fine-tuning."""
    torch.manual_seed(1)
    teacher = F.gelu(x.detach() @ (w.detach() + 0.01 * torch.randn_like(w)).T)
    xi = x.detach().requires_grad_()
    h = F.linear(xi, w, b) if input_bits == "exact" else linear(xi, w, b, input_bits=input_bits, stochastic=stochastic)
    loss = F.mse_loss(F.gelu(h), teacher)
    return torch.autograd.grad(loss, [xi, w, b])


@pytest.fixture(scope="module")
def ffn():
    torch.manual_seed(0)
    x = bert_like_hidden(batch=2, seq=128)
    w = _param(3072, 768, scale=0.02)
    b = _param(3072, scale=0.02)
    return x, w, b, _ffn_grads(x, w, b, "exact")


@pytest.mark.parametrize("bits, max_rel, min_cos", [(8, 3e-3, 0.99999), (4, 4e-2, 0.999), (2, 0.5, 0.9)])
def test_quantized_weight_grad_realistic(ffn, bits, max_rel, min_cos):
    x, w, b, exact = ffn
    gx, gw, gb = _ffn_grads(x, w, b, bits)
    # The input and bias gradients never touch the saved input: bit-equal to slimfit's uncompressed
    # path (same kernels), and to PyTorch's within the last bit (BLAS may split the same GEMM
    # differently between threads on a loaded machine, so bit equality with F.linear's is not stable).
    uncompressed = _ffn_grads(x, w, b, None)
    assert torch.equal(gx, uncompressed[0]) and torch.equal(gb, uncompressed[2])
    torch.testing.assert_close(gx, exact[0], rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(gb, exact[2], rtol=1e-5, atol=1e-12)
    assert rel_err(gw, exact[1]) <= max_rel
    assert cos_sim(gw, exact[1]) >= min_cos


@pytest.mark.parametrize("bits, min_cos", [(8, 0.9999), (4, 0.98), (2, 0.85)])
def test_quantized_weight_grad_worst_case(bits, min_cos):
    """Gaussian inputs and an independent random upstream gradient: quantization errors do not
    average out, so rel err of dW ~= the rel rms error of the saved input (theory: a step of
    ~5.2 sigma / (2**bits - 1), uniform error step/sqrt(12)). cos floors = 1/sqrt(1+(1.5*theory)^2)
    rounded down: 8-bit 0.9999, 4-bit 0.98, 2-bit 0.85."""
    torch.manual_seed(0)
    x = torch.randn(256, 768, requires_grad=True)
    w = _param(256, 768, scale=0.02)
    g = torch.randn(256, 256)
    (exact,) = torch.autograd.grad(F.linear(x, w), w, g)
    (got,) = torch.autograd.grad(linear(x, w, input_bits=bits), w, g)
    assert rel_err(got, exact) <= 1.3 * quant_rel_err_theory(bits)
    assert cos_sim(got, exact) >= min_cos


def test_stochastic_rounding_unbiased():
    """dW is linear in the saved input, so with unbiased stochastic rounding the mean of dW over
    n independent seeds converges to the exact dW with error ~ 1/sqrt(n)."""
    torch.manual_seed(0)
    x = torch.randn(64, 128, requires_grad=True)
    w = _param(32, 128)
    g = torch.randn(64, 32)
    (exact,) = torch.autograd.grad(F.linear(x, w), w, g)
    samples = torch.stack([
        torch.autograd.grad(linear(x, w, input_bits=4, stochastic=True), w, g)[0] for _ in range(256)
    ])
    err1 = sum(rel_err(s, exact) for s in samples[:16]) / 16
    for n in (4, 16, 64, 256):
        err_n = rel_err(samples[:n].mean(0), exact)
        assert err_n <= 2.0 * err1 / math.sqrt(n), (n, err_n, err1)
    assert rel_err(samples.mean(0), exact) < err1 / 8
    # nearest rounding is deterministic: its error does not average away
    (near,) = torch.autograd.grad(linear(x, w, input_bits=4), w, g)
    assert rel_err(samples.mean(0), exact) < rel_err(near, exact) / 4


@pytest.mark.parametrize("shape", [(3, 7, IN), (1, 5, IN), (0, IN), (2, 100, IN)])
@pytest.mark.parametrize("bias", [True, False])
def test_bytes_saved(shape, bias):
    x = torch.randn(*shape, requires_grad=True)
    n = x.numel()
    b = _param(OUT) if bias else None
    frozen = _param(OUT, IN, trainable=False)
    trainable = _param(OUT, IN)
    assert saved(lambda x: linear(x, frozen, b), x) == 0
    assert saved(lambda x: linear(x, trainable, b), x) == n * 4
    for bits in (8, 4, 2):
        assert saved(lambda x, bits=bits: linear(x, trainable, b, input_bits=bits), x) == q_bytes(n, bits)
    assert saved(lambda x: linear(x, trainable, b, input_bits=4, group_size=64), x) == q_bytes(n, 4, 64)
    # (PyTorch's own autograd also skips saving the input of a frozen fp32 linear; the
    # difference shows under autocast, see test_frozen_path_under_autocast_saves_nothing)
    assert saved(lambda x: F.linear(x, trainable, b), x) == n * 4


def test_frozen_weight_and_input_not_requiring_grad_saves_nothing():
    x = torch.randn(4, IN)
    w = _param(OUT, IN, trainable=False)
    b = _param(OUT)
    run = measure(lambda x: linear(x, w, b), x, loss_fn=lambda out: out.sum())
    assert run.total == 0 and b.grad is None  # measure computes and drops the gradients (no .grad left)


class _CountMM(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.mm += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("trainable, expected_mm", [(False, 1), (True, 2)])
def test_frozen_path_skips_weight_gradient_gemm(trainable, expected_mm):
    x = torch.randn(3, 5, IN, requires_grad=True)
    w = _param(OUT, IN, trainable=trainable)
    y = linear(x, w, _param(OUT))
    with _CountMM() as counter:
        y.sum().backward()
    assert counter.mm == expected_mm
    assert (w.grad is not None) == trainable


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_noncontiguous_input_same_as_contiguous(bits):
    x = _inputs((6, 10, IN), noncontig=True)
    xc = x.detach().contiguous().requires_grad_()
    w, b = _param(OUT, IN), _param(OUT)
    g = torch.randn(6, 10, OUT)
    got = torch.autograd.grad(linear(x, w, b, input_bits=bits), [x, w, b], g)
    ref = torch.autograd.grad(linear(xc, w, b, input_bits=bits), [xc, w, b], g)
    for a, c in zip(got, ref):
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_empty_batch(bits):
    x = torch.randn(0, 3, IN, requires_grad=True)
    w, b = _param(OUT, IN), _param(OUT)
    y = linear(x, w, b, input_bits=bits)
    assert y.shape == (0, 3, OUT)
    gx, gw, gb = torch.autograd.grad(y.sum(), [x, w, b])
    assert gx.shape == x.shape and torch.equal(gw, torch.zeros_like(w)) and torch.equal(gb, torch.zeros_like(b))


@pytest.mark.parametrize("trainable, bits", [(False, None), (True, None), (True, 8), (True, 4)])
def test_autocast_bf16(trainable, bits):
    torch.manual_seed(0)
    x = torch.randn(4, 16, IN, requires_grad=True)
    w, b = _param(OUT, IN, trainable=trainable), _param(OUT)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(x, w, b, input_bits=bits)
        y_ref = F.linear(x, w, b)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    got = _grads(y, [x, w, b], g)
    ref = _grads(y_ref, [x, w, b], g)
    for a, c in zip(got, ref):
        assert a.dtype == c.dtype == torch.float32
    assert torch.equal(got[0], ref[0]) and torch.equal(got[-1], ref[-1])
    if trainable:
        # bits=None: same bf16 GEMM as PyTorch; quantized: bf16 rounding dominates at 8 bits
        bound = {None: 0.0, 8: 1e-2, 4: 0.15}[bits]
        assert rel_err(got[1], ref[1]) <= bound


def test_frozen_path_under_autocast_saves_nothing():
    x = torch.randn(4, 16, IN, requires_grad=True)
    w = _param(OUT, IN, trainable=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert saved(lambda x: linear(x, w), x) == 0
        # PyTorch keeps the bf16 copy of the weight alive for backward
        assert saved(lambda x: F.linear(x, w), x) == OUT * IN * 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(dtype):
    x = torch.randn(4, 8, IN, dtype=dtype, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(OUT, IN, dtype=dtype) * 0.1)
    y, y_ref = linear(x, w, input_bits=8), F.linear(x, w)
    assert y.dtype == dtype and torch.equal(y, y_ref)
    g = torch.randn_like(y)
    got, ref = _grads(y, [x, w], g), _grads(y_ref, [x, w], g)
    assert torch.equal(got[0], ref[0])
    assert rel_err(got[1], ref[1]) <= 2e-2


def test_errors_name_the_problem():
    w = _param(OUT, IN)
    with pytest.raises(TypeError, match="unsupported dtype torch.float64"):
        linear(torch.randn(2, IN, dtype=torch.float64), w)
    with pytest.raises(TypeError, match="unsupported dtype torch.int64"):
        linear(torch.ones(2, IN, dtype=torch.int64), w)
    with pytest.raises(ValueError, match="mismatched shapes"):
        linear(torch.randn(2, IN + 1), w)
    with pytest.raises(ValueError, match="mismatched shapes: bias"):
        linear(torch.randn(2, IN), w, torch.zeros(OUT + 1))
    with pytest.raises(ValueError, match="weight must be 2-D"):
        linear(torch.randn(2, IN), torch.randn(IN))
    with pytest.raises(ValueError, match="input_bits must be one of"):
        linear(torch.randn(2, IN), w, input_bits=3)
    with pytest.raises(ValueError, match="group_size"):
        linear(torch.randn(2, IN), w, input_bits=8, group_size=100)
    with pytest.raises(TypeError, match="mismatched dtypes"):
        linear(torch.randn(2, IN, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="slimfit.linear: input_bits must be one of"):  # not slimfit.quantize's
        linear(torch.randn(2, IN), w, input_bits=8.0)
    with pytest.raises(TypeError, match="stochastic must be True or False"):  # "no" is truthy: rounding on
        linear(torch.randn(2, IN), w, input_bits=8, stochastic="no")
    with pytest.raises(ValueError, match="different devices .*weight on meta.*move them to one device"):
        linear(torch.randn(2, IN), torch.randn(OUT, IN, device="meta", requires_grad=True))
    x = torch.randn(2, IN, requires_grad=True)
    (gx,) = torch.autograd.grad(F.linear(x, w).sum(), x, create_graph=True)  # PyTorch allows it
    with pytest.raises(RuntimeError, match="slimfit.linear: double backward"):
        torch.autograd.grad(linear(x, w).sum(), x, create_graph=True)


def test_no_grad_is_plain_linear():
    x = torch.randn(3, IN)
    w = _param(OUT, IN)
    with torch.no_grad():
        y = linear(x, w, input_bits=4)
    assert torch.equal(y, F.linear(x, w)) and y.grad_fn is None


def test_composes_with_gelu_in_an_mlp():
    """A frozen linear feeding a quantized GELU: gradients reach the input, bit-exact where
    nothing is compressed between (the frozen linear), close through the 8-bit GELU."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, IN, requires_grad=True)
    w1, w2 = _param(128, IN, trainable=False), _param(OUT, 128)
    y = linear(gelu(linear(x, w1), bits=8), w2, input_bits=8)
    y_ref = F.linear(F.gelu(F.linear(x, w1)), w2)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    got, ref = _grads(y, [x, w2], g), _grads(y_ref, [x, w2], g)
    assert rel_err(got[0], ref[0]) < 1e-2 and rel_err(got[1], ref[1]) < 1e-2


@pytest.mark.parametrize("bits", [None, 8, 4])
@pytest.mark.parametrize("into", ["input", "weight", "grad"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_reaches_every_gradient(bits, into, value):
    """Guard (issue #30): wherever F.linear's gradients are NaN/Inf, slimfit's are too (a non-finite
    group of the quantized input dequantizes to non-finite values)."""
    gen = torch.Generator().manual_seed(0)
    x0, w0, g = (torch.randn(*shape, generator=gen) for shape in ((6, IN), (OUT, IN), (6, OUT)))
    {"input": x0, "weight": w0, "grad": g}[into][2, 3] = value
    grads = []
    for fn in (F.linear, lambda x, w, b: linear(x, w, b, input_bits=bits)):
        x, w, b = x0.clone().requires_grad_(), w0.clone().requires_grad_(), torch.zeros(OUT, requires_grad=True)
        grads.append(torch.autograd.grad(fn(x, w, b), [x, w, b], g))
    assert not nonfinite_missed(grads[1], grads[0])
