"""slimfit.autograd.layer_norm: exact forward; backward from x_hat (int8 / top-k / full) and rstd only."""
import math

import pytest
import torch
import torch.nn.functional as F
from _grad_utils import (  # noqa: F401  (single_thread: autouse fixture)
    OUTLIER_CHANNELS,
    cos_sim,
    nonfinite_missed,
    q_bytes,
    quant_rel_err_theory,
    rel_err,
    saved,
    single_thread,
)

from slimfit.autograd import layer_norm
from slimfit.autograd.layernorm import topk_keep

H = 768
MODES = ["full", "int8", "topk"]


def _affine(shape, weight=True, bias=True):
    w = torch.nn.Parameter(torch.rand(shape) * 0.5 + 0.75) if weight else None
    b = torch.nn.Parameter(torch.randn(shape) * 0.05) if bias else None
    return w, b


def _grads(y, inputs, g):
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    return torch.autograd.grad(y, wanted, g)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape, nshape", [
    ((4, 64), (64,)), ((2, 5, 77), (77,)), ((1, 768), (768,)), ((3, 4, 6, 8), (6, 8)), ((0, 32), (32,)),
])
@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, False)])
def test_forward_exact_and_grads_close(mode, shape, nshape, affine):
    x = (torch.randn(shape) * 2 + 0.5).requires_grad_()
    w, b = _affine(nshape, *affine)
    y = layer_norm(x, nshape, w, b, save=mode)
    y_ref = F.layer_norm(x, nshape, w, b)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    got, ref = _grads(y, [x, w, b], g), _grads(y_ref, [x, w, b], g)
    for a, c in zip(got, ref):
        assert a.shape == c.shape and a.dtype == c.dtype
    if mode == "full":  # same math as PyTorch, from x_hat and rstd
        for a, c in zip(got, ref):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    if b is not None:  # the bias gradient never needs x_hat
        torch.testing.assert_close(got[-1], ref[-1], rtol=1e-5, atol=1e-5)


def _residual_stream(seed=0):
    """Pre-LayerNorm residual stream shaped like BERT's: shared mean direction, outlier channels."""
    gen = torch.Generator().manual_seed(seed)
    e = torch.randn(2, 128, H, generator=gen) * 0.5 + torch.randn(1, 1, H, generator=gen) * 0.3
    e[..., list(OUTLIER_CHANNELS)] += 6.0
    return e.requires_grad_()


@pytest.fixture(scope="module")
def realistic():
    """LayerNorm -> linear -> regression loss: the upstream gradient correlates with x_hat."""
    torch.manual_seed(0)
    x = _residual_stream()
    w, b = _affine(H)
    w2 = torch.randn(256, H) * 0.03
    target = (F.layer_norm(x.detach() + 0.1 * torch.randn_like(x), (H,), w.detach(), b.detach()) @ w2.T)

    def grads(fn):
        return torch.autograd.grad(F.mse_loss(fn(x, (H,), w, b) @ w2.T, target), [x, w, b])

    return grads, grads(F.layer_norm)


@pytest.mark.parametrize("mode, dx_max_rel, dw_max_rel", [("full", 1e-6, 1e-6), ("int8", 3e-3, 4e-3)])
def test_grad_error_realistic(realistic, mode, dx_max_rel, dw_max_rel):
    """Measured: int8 dx 1.2e-3, dw 2.2e-3."""
    grads, exact = realistic
    gx, gw, gb = grads(lambda *a: layer_norm(*a, save=mode))
    assert rel_err(gx, exact[0]) <= dx_max_rel
    assert rel_err(gw, exact[1]) <= dw_max_rel
    assert rel_err(gb, exact[2]) <= 1e-6


def test_topk_grad_realistic(realistic):
    """x_hat top-10%: dx = rstd*(gw - mean(gw) - x_hat*mean(gw*x_hat)); only the last term uses
    x_hat, so dx stays close (measured cos 0.9958 with this x_hat-correlated gradient). The
    weight gradient sum(g*x_hat) sees the kept entries only (measured cos 0.959 here, where the
    outlier channels carry much of x_hat's energy); top-k is meant for frozen LayerNorms."""
    grads, exact = realistic
    gx, gw, gb = grads(lambda *a: layer_norm(*a, save="topk", keep_ratio=0.1))
    assert cos_sim(gx, exact[0]) >= 0.99
    assert cos_sim(gw, exact[1]) >= 0.9
    assert rel_err(gb, exact[2]) <= 1e-6


def test_int8_random_gradient():
    """Gaussian rows, independent random gradient: dw = sum_rows g*x_hat has the relative error
    of x_hat's 8-bit rounding (theory 5.9e-3, measured 5.8e-3); dx only feels it through the
    projection term (measured 3e-4)."""
    torch.manual_seed(0)
    x = torch.randn(256, H, requires_grad=True)
    w, b = _affine(H)
    g = torch.randn(256, H)
    exact = torch.autograd.grad(F.layer_norm(x, (H,), w, b), [x, w, b], g)
    got = torch.autograd.grad(layer_norm(x, (H,), w, b, save="int8"), [x, w, b], g)
    assert rel_err(got[0], exact[0]) <= 1e-3
    assert rel_err(got[1], exact[1]) <= 1.3 * quant_rel_err_theory(8)


def test_topk_random_gradient_matches_energy_argument():
    """With a gradient independent of x_hat, cos(dw_topk, dw) ~= ||x_hat_k|| / ||x_hat|| (the
    square root of the energy kept: for Gaussian rows keeping 10% keeps 44% of it, cos ~0.66),
    and dx's error is ~ sqrt((1 - kept energy) / D) (cos >= 0.999 at D = 768)."""
    torch.manual_seed(0)
    x = torch.randn(256, H, requires_grad=True)
    w, b = _affine(H)
    g = torch.randn(256, H)
    exact = torch.autograd.grad(F.layer_norm(x, (H,), w, b), [x, w, b], g)
    got = torch.autograd.grad(layer_norm(x, (H,), w, b, save="topk"), [x, w, b], g)
    xh = F.layer_norm(x.detach(), (H,))
    kept = xh.abs().topk(topk_keep(0.1, H), dim=-1).values.pow(2).sum() / xh.pow(2).sum()
    assert abs(cos_sim(got[1], exact[1]) - math.sqrt(kept)) < 0.05
    assert cos_sim(got[0], exact[0]) >= 0.999


def test_keep_ratio_one_is_lossless():
    x = torch.randn(8, 64, requires_grad=True)
    w, b = _affine(64)
    g = torch.randn(8, 64)
    got = torch.autograd.grad(layer_norm(x, 64, w, b, save="topk", keep_ratio=1.0), [x, w, b], g)
    ref = torch.autograd.grad(F.layer_norm(x, (64,), w, b), [x, w, b], g)
    for a, c in zip(got, ref):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def test_stochastic_int8_converges():
    torch.manual_seed(0)
    x = torch.randn(16, 256, requires_grad=True)
    w, b = _affine(256)
    g = torch.randn(16, 256)
    (exact,) = torch.autograd.grad(F.layer_norm(x, (256,), w, b), w, g)
    samples = torch.stack([
        torch.autograd.grad(layer_norm(x, 256, w, b, save="int8", stochastic=True), w, g)[0] for _ in range(64)
    ])
    err1 = sum(rel_err(s, exact) for s in samples[:8]) / 8
    for n in (4, 16, 64):  # dw is linear in x_hat: unbiased
        assert rel_err(samples[:n].mean(0), exact) <= 2 * err1 / math.sqrt(n)


@pytest.mark.parametrize("shape", [(2, 128, H), (3, 77), (1, 1, 40), (0, H)])
def test_bytes_saved(shape):
    x = torch.randn(shape, requires_grad=True)
    d = shape[-1]
    rows = x.numel() // d
    w, b = _affine(d)
    rstd = 4 * rows
    assert saved(lambda x: layer_norm(x, d, w, b, save="full"), x) == rows * d * 4 + rstd
    assert saved(lambda x: layer_norm(x, d, w, b, save="int8"), x) == q_bytes(rows * d, 8) + rstd
    assert saved(lambda x: layer_norm(x, d, w, b, save="int8", group_size=64), x) == q_bytes(rows * d, 8, 64) + rstd
    k = topk_keep(0.1, d)
    assert saved(lambda x: layer_norm(x, d, w, b, save="topk"), x) == rows * k * (4 + 2) + rstd
    k = topk_keep(0.25, d)
    assert saved(lambda x: layer_norm(x, d, w, b, save="topk", keep_ratio=0.25), x) == rows * k * (4 + 2) + rstd
    # frozen affine (SlimFit's case for top-k): same bytes, weight is a parameter
    wf, bf = torch.nn.Parameter(w.detach(), requires_grad=False), torch.nn.Parameter(b.detach(), requires_grad=False)
    assert saved(lambda x: layer_norm(x, d, wf, bf, save="topk"), x) == rows * topk_keep(0.1, d) * 6 + rstd


def test_bytes_saved_bf16_topk_values_in_input_dtype():
    x = torch.randn(4, 64, H, dtype=torch.bfloat16, requires_grad=True)
    rows = 4 * 64
    assert saved(lambda x: layer_norm(x, H, save="topk"), x) == rows * topk_keep(0.1, H) * (2 + 2) + rows * 4
    assert saved(lambda x: layer_norm(x, H, save="full"), x) == rows * H * 2 + rows * 4


def test_noncontiguous_input():
    base = torch.randn(64, 10, 3)
    x = base.permute(2, 1, 0).requires_grad_()  # (3, 10, 64), normalized dim strided
    xc = x.detach().contiguous().requires_grad_()
    w, b = _affine(64)
    g = torch.randn(3, 10, 64)
    for mode in MODES:
        y = layer_norm(x, 64, w, b, save=mode)
        assert torch.equal(y, F.layer_norm(x, (64,), w, b))
        got = torch.autograd.grad(y, [x, w, b], g)
        ref = torch.autograd.grad(layer_norm(xc, 64, w, b, save=mode), [xc, w, b], g)
        for a, c in zip(got, ref):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_autocast_bf16(mode):
    """CPU autocast leaves layer_norm alone: bf16 activations with fp32 parameters give a bf16
    output, fp32 inputs an fp32 one, as PyTorch does. Gradients are compared with an fp32
    reference: ours may be at most twice as far from it as PyTorch's own bf16 gradients (plus the
    format's error); we accumulate dw/db in fp32, PyTorch rounds them to bf16."""
    torch.manual_seed(0)
    x = torch.randn(4, 16, 64)
    w, b = _affine(64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = F.linear(x, torch.randn(64, 64) * 0.1).detach().requires_grad_()  # bf16 activation
        y, y_ref = layer_norm(h, 64, w, b, save=mode), F.layer_norm(h, (64,), w, b)
        xr = x.clone().requires_grad_()
        y32, y32_ref = layer_norm(xr, 64, w, b, save=mode), F.layer_norm(xr, (64,), w, b)
    assert y.dtype == y_ref.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    assert y32.dtype == y32_ref.dtype == torch.float32 and torch.equal(y32, y32_ref)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [h, w, b], g)
    ref = torch.autograd.grad(y_ref, [h, w, b], g)
    exact = torch.autograd.grad(F.layer_norm(h.float(), (64,), w, b), [h, w, b], g.float())
    for a, c in zip(got, ref):
        assert a.dtype == c.dtype
    if mode == "topk":  # 7 of 64 entries kept per row
        assert cos_sim(got[0], exact[0]) >= 0.98
    else:
        fmt = {"full": 0.0, "int8": 4e-3}[mode]
        assert rel_err(got[0], exact[0]) <= 2 * rel_err(ref[0], exact[0]) + 2e-3 + fmt
        assert rel_err(got[1], exact[1]) <= 2 * rel_err(ref[1], exact[1]) + 1e-3 + 2 * fmt
    assert rel_err(got[2], exact[2]) <= 2 * rel_err(ref[2], exact[2]) + 1e-6


def test_half_inputs():
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(8, 64, dtype=dtype, requires_grad=True)
        w = torch.nn.Parameter(torch.ones(64, dtype=dtype))
        y = layer_norm(x, 64, w, None)
        assert y.dtype == dtype and torch.equal(y, F.layer_norm(x, (64,), w, None))
        g = torch.randn_like(y)
        got = torch.autograd.grad(y, [x, w], g)
        ref = torch.autograd.grad(F.layer_norm(x, (64,), w, None), [x, w], g)
        assert rel_err(got[0], ref[0]) < 2e-2 and rel_err(got[1], ref[1]) < 2e-2


def test_errors_name_the_problem():
    x = torch.randn(4, 64, requires_grad=True)
    with pytest.raises(ValueError, match="mismatched shapes"):
        layer_norm(x, 32)
    with pytest.raises(ValueError, match="mismatched shapes: weight"):
        layer_norm(x, 64, torch.ones(32))
    with pytest.raises(ValueError, match="save must be one of"):
        layer_norm(x, 64, save="int4")
    with pytest.raises(ValueError, match="keep_ratio"):
        layer_norm(x, 64, save="topk", keep_ratio=0.0)
    with pytest.raises(TypeError, match="unsupported dtype torch.float64"):
        layer_norm(x.double(), 64)
    with pytest.raises(RuntimeError, match="slimfit.layer_norm: double backward"):
        torch.autograd.grad(layer_norm(x, 64).sum(), x, create_graph=True)


@pytest.mark.parametrize("save", ["full", "int8", "topk"])
@pytest.mark.parametrize("needs", ["x", "w", "b", "wb", "xwb"])
def test_every_subset_of_inputs_needing_grad(save, needs):
    """A frozen input below a trainable norm (x without grad, weight with): each gradient that is
    asked for matches F.layer_norm's (exactly computable ones to fp32 rounding; x̂-based ones within
    the saved format's error), and none is computed for what does not need it."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 5, 96, generator=gen) * 2 + 1
    w, b = torch.randn(96, generator=gen), torch.randn(96, generator=gen)
    g = torch.randn(6, 5, 96, generator=gen)
    ours = [t.clone().requires_grad_(name in needs) for name, t in zip("xwb", (x, w, b))]
    ref = [t.clone().requires_grad_(name in needs) for name, t in zip("xwb", (x, w, b))]
    layer_norm(ours[0], (96,), ours[1], ours[2], save=save, keep_ratio=1.0).backward(g)
    F.layer_norm(ref[0], (96,), ref[1], ref[2]).backward(g)
    for name, a, r in zip("xwb", ours, ref):
        if name in needs and (save != "int8" or name == "b"):  # keep_ratio 1: top-k keeps every entry
            torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=1e-5)
        elif name in needs:  # x̂ at 8 bits: the gradient's relative error is the format's (~0.5%)
            assert rel_err(a.grad, r.grad) < 1e-2, (name, rel_err(a.grad, r.grad))
        else:
            assert a.grad is None


# ------------------------------------------------------------------ NaN / Inf stay visible (issue #30)
NAN, INF = float("nan"), float("inf")


def _inject(t, where):
    """A non-finite pattern in row 1 of t viewed as (rows, D)."""
    v = t.view(-1, t.shape[-1])
    kind, value = where
    if kind == "one":
        v[1, 3] = value
    elif kind == "many":  # more non-finite entries than top-k keeps (k = 2 of 16)
        v[1, [0, 5, 9]] = value
    elif kind == "row":
        v[1] = value
    elif kind == "mixed":
        v[1, 2], v[1, 4] = INF, -INF


PATTERNS = [("one", NAN), ("one", INF), ("one", -INF), ("many", INF), ("row", NAN), ("mixed", None)]
TRAINS = [(True, True), (False, True), (True, False), (False, False)]  # (weight, bias) require grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trains", TRAINS)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("into", ["input", "grad"])
def test_nonfinite_reaches_every_gradient(mode, dtype, trains, pattern, into):
    """Wherever F.layer_norm's gradients (input, weight, bias) are NaN/Inf, slimfit's are too, in every
    mode, trainable or frozen affine. The reporter's case: top-k, a NaN input row of 16 (PyTorch's dw: 16
    non-finite entries; top-k kept 2 of the row's NaN and dw had 2)."""
    gen = torch.Generator().manual_seed(0)
    x0, g = (torch.randn(4, 16, generator=gen).to(dtype) for _ in range(2))
    _inject(x0 if into == "input" else g, pattern)
    w0, b0 = (torch.rand(16, generator=gen) + 0.5).to(dtype), torch.randn(16, generator=gen).to(dtype)
    grads = []
    for fn in (F.layer_norm, lambda *a: layer_norm(*a, save=mode)):
        x = x0.clone().requires_grad_()
        w, b = w0.clone().requires_grad_(trains[0]), b0.clone().requires_grad_(trains[1])
        grads.append(_grads(fn(x, (16,), w, b), [x, w, b], g))
    assert not nonfinite_missed(grads[1], grads[0])


@pytest.mark.parametrize("mode", MODES)
def test_nonfinite_row_statistic_without_eps(mode):
    """eps = 0 and a constant row: rstd is Inf and PyTorch's x̂ row is NaN (0 · Inf); so is every entry
    of its dw. A strided upstream gradient takes the (rows, d) path of backward."""
    x0 = torch.randn(3, 5, 40)
    x0[1, 2] = 2.0
    g = torch.randn(5, 3, 40).transpose(0, 1)
    grads = []
    for fn in (F.layer_norm, lambda *a: layer_norm(*a, save=mode)):
        x, w, b = x0.clone().requires_grad_(), torch.ones(40, requires_grad=True), torch.zeros(40, requires_grad=True)
        grads.append(_grads(fn(x, (40,), w, b, 0.0), [x, w, b], g))
    assert (~torch.isfinite(grads[0][1])).all()  # the check below can fail
    assert not nonfinite_missed(grads[1], grads[0])


def test_argument_errors_name_the_problem_and_the_fix():
    """Values that silently gave a wrong result (NaN rows from eps, rounding switched on by a truthy
    string, a float size truncated), or failed deep in a kernel or in backward, are refused up front."""
    x = torch.randn(4, 64, requires_grad=True)
    w, b = torch.ones(64, requires_grad=True), torch.zeros(64, requires_grad=True)
    for eps in (float("nan"), -1e-5, "1e-5"):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            layer_norm(x, 64, w, b, eps=eps)
    for ratio in (float("nan"), "0.1"):  # checked whatever save is: a frozen weight switches to top-k
        with pytest.raises(ValueError, match="keep_ratio must be a number in"):
            layer_norm(x, 64, w, b, save="int8", keep_ratio=ratio)
    with pytest.raises(TypeError, match="stochastic must be True or False"):
        layer_norm(x, 64, w, b, stochastic="no")
    with pytest.raises(TypeError, match="normalized_shape must be ints"):
        layer_norm(x, (64.5,), w, b)
    with pytest.raises(TypeError, match="mismatched dtypes .*weight=torch.float16.*give weight and bias"):
        layer_norm(x, 64, w.half(), b)
    with pytest.raises(TypeError, match="mismatched dtypes .*bias=torch.bfloat16"):
        layer_norm(x, 64, w, b.bfloat16())
    with pytest.raises(ValueError, match="different devices .*weight on meta.*move them to one device"):
        layer_norm(x, 64, torch.ones(64, device="meta", requires_grad=True), None)
    with pytest.raises(ValueError, match="group_size must be one of"):
        layer_norm(x, 64, w, b, group_size=128.0)
    # what PyTorch's mixed-type kernel accepts is computed: a half input with fp32 weight and bias
    xh = x.detach().bfloat16().requires_grad_()
    assert torch.equal(layer_norm(xh, 64, w, b), F.layer_norm(xh, (64,), w, b))
