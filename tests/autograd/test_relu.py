"""slimfit's ReLU: output and gradient bit-identical to PyTorch's, one bit per element saved."""
import pytest
import torch

from slimfit.autograd.relu import relu
from slimfit.memory import saved_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1,), (3, 7), (2, 5, 33)])
def test_matches_pytorch_bit_for_bit(shape, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    x.view(-1)[0] = 0.0  # the kink: PyTorch's gradient there is 0
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = relu(a), torch.relu(b)
    assert torch.equal(ya, yb)
    (ga,), (gb,) = torch.autograd.grad(ya, a, g), torch.autograd.grad(yb, b, g)
    assert torch.equal(ga, gb)


def test_non_finite_values_as_pytorch():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0, -1.0], requires_grad=True)
    g = torch.full((5,), float("nan"))
    (ours,) = torch.autograd.grad(relu(x), x, g)
    (theirs,) = torch.autograd.grad(torch.relu(x), x, g)
    assert torch.equal(ours.isnan(), theirs.isnan()) and torch.equal(relu(x).isnan(), torch.relu(x).isnan())


def test_saves_one_bit_per_element():
    x = torch.randn(4, 1000, requires_grad=True)
    assert saved_bytes(relu, x) == (4000 + 7) // 8
    assert saved_bytes(torch.relu, x) == 4000 * 4


def test_refuses_integer_input():
    with pytest.raises(TypeError, match="relu"):
        relu(torch.ones(3, dtype=torch.int64))
