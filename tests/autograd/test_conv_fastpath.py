"""slimfit.autograd.conv: frozen weight -> no activation saved, gradients bit-identical to PyTorch's;
trainable weight -> PyTorch's convolution itself."""
import pytest
import torch
import torch.nn.functional as F
from _grad_utils import saved, single_thread  # noqa: F401  (single_thread: autouse fixture)

from slimfit.autograd.conv import conv

_F = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}

CASES = [  # (input shape, weight shape, kwargs)
    ((3, 3, 16, 16), (8, 3, 4, 4), dict(stride=4)),  # a ViT patch embedding, small
    ((2, 4, 9, 11), (6, 2, 3, 3), dict(stride=(2, 1), padding=1, dilation=(1, 2), groups=2)),
    ((2, 3, 17), (5, 3, 3), dict(padding=2)),
    ((1, 2, 5, 6, 7), (3, 2, 2, 2, 2), dict()),
    ((1, 1, 1, 1), (2, 1, 1, 1), dict()),
]


def _frozen(wshape, dtype=torch.float32, bias=True):
    w = torch.nn.Parameter(torch.randn(wshape, dtype=dtype), requires_grad=False)
    b = torch.nn.Parameter(torch.randn(wshape[0], dtype=dtype)) if bias else None
    return w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, wshape, kw", CASES)
def test_frozen_weight_gradients_bit_identical(shape, wshape, kw, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    w, b = _frozen(wshape, dtype)
    f = _F[len(wshape)]
    y, y_ref = conv(x, w, b, **kw), f(x, w, b, **kw)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    for a, r in zip(torch.autograd.grad(y, [x, b], g), torch.autograd.grad(y_ref, [x, b], g)):
        assert a.dtype == r.dtype and torch.equal(a, r)
    # the pixel-values case: the input needs no gradient, only the bias trains
    xd = x.detach()
    gb = torch.autograd.grad(conv(xd, w, b, **kw), b, g)[0]
    assert torch.equal(gb, torch.autograd.grad(f(xd, w, b, **kw), b, g)[0])


@pytest.mark.parametrize("shape, wshape, kw", CASES)
def test_frozen_weight_saves_nothing(shape, wshape, kw):
    x = torch.randn(shape, requires_grad=True)
    w, b = _frozen(wshape)
    f = _F[len(wshape)]
    assert saved(lambda t: conv(t, w, b, **kw), x) == 0  # the weight is a parameter, not an activation
    assert saved(lambda t: conv(t, w, b, **kw), x.detach()) == 0
    # PyTorch keeps the input whenever anything needs a gradient, e.g. only the bias
    assert saved(lambda t: f(t, w, b, **kw), x.detach()) == x.numel() * 4


def test_no_bias_and_frozen_everything():
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    w, _ = _frozen((4, 3, 2, 2), bias=False)
    y = conv(x, w, None, stride=2)
    g = torch.randn_like(y)
    assert torch.equal(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(F.conv2d(x, w, None, 2), x, g)[0])
    b = torch.zeros(4)
    assert conv(x.detach(), w, b, stride=2).grad_fn is None  # nothing needs a gradient


def test_trainable_weight_is_pytorch():
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(4, 3, 2, 2))
    y = conv(x, w, None, stride=2)
    assert type(y.grad_fn).__name__ == "ConvolutionBackward0"
    assert saved(lambda t: conv(t, w, None, stride=2), x) == saved(lambda t: F.conv2d(t, w, None, 2), x)


def test_autocast_bf16_bit_identical():
    x = torch.randn(3, 3, 16, 16, requires_grad=True)
    w, b = _frozen((8, 3, 4, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = conv(x, w, b, stride=4), F.conv2d(x, w, b, stride=4)
    assert y.dtype == y_ref.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    g = torch.randn_like(y)
    for a, r in zip(torch.autograd.grad(y, [x, b], g), torch.autograd.grad(y_ref, [x, b], g)):
        assert a.dtype == r.dtype and torch.equal(a, r)
    # PyTorch keeps the bf16 copies of input and weight under autocast; the fast path keeps none
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert saved(lambda t: conv(t, w, b, stride=4), x) == 0


def test_unbatched_input_and_errors():
    w, b = _frozen((4, 3, 2, 2))
    x = torch.randn(3, 8, 8, requires_grad=True)  # unbatched: PyTorch's conv
    assert torch.equal(conv(x, w, b, stride=2), F.conv2d(x, w, b, 2))
    with pytest.raises(ValueError, match="stride must be"):
        conv(torch.randn(1, 3, 8, 8), w, b, stride=(1, 2, 3))
    with pytest.raises(ValueError, match="weight must be 3-, 4- or 5-D"):
        conv(torch.randn(2, 3), torch.randn(3, 3), None)
    with pytest.raises(TypeError, match="mismatched dtypes"):
        conv(torch.randn(1, 3, 8, 8, requires_grad=True), w.bfloat16(), None)
    with pytest.raises(ValueError, match="different devices .*weight on meta.*move them to one device"):
        conv(torch.randn(1, 3, 8, 8, requires_grad=True), w.to("meta"), None)
    with pytest.raises(RuntimeError, match="slimfit.conv: double backward"):
        x = torch.randn(1, 3, 8, 8, requires_grad=True)
        torch.autograd.grad(conv(x, w, b).sum(), x, create_graph=True)
