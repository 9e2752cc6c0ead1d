"""torch.compile of a small block built from slimfit's autograd functions.

Recorded in docs/autograd.md: with nearest rounding and no dropout the block compiles to one
graph with no break; dropout (and stochastic rounding without a seed) draws its seed with
`.item()` from torch's generator, one graph break per call.
"""
import pytest
import torch
import torch._dynamo
from torch import nn

from slimfit.autograd import dropout, gelu, layer_norm, linear, matmul

from _grad_utils import single_thread  # noqa: F401  (autouse fixture)


class Block(nn.Module):
    def __init__(self, d=32, h=64, p_drop=0.0, ln_save="int8"):
        super().__init__()
        self.fc1, self.fc2, self.ln = nn.Linear(d, h), nn.Linear(h, d), nn.LayerNorm(d)
        self.fc1.weight.requires_grad_(False)  # frozen fast path
        self.p_drop, self.ln_save = p_drop, ln_save

    def forward(self, x):
        h = gelu(linear(x, self.fc1.weight, self.fc1.bias), bits=4)
        h = linear(h, self.fc2.weight, self.fc2.bias, input_bits=8)
        if self.p_drop:
            h = dropout(h, self.p_drop)
        a = matmul(h, h.transpose(-1, -2), a_bits=8, b_bits=8).softmax(-1)
        h = h + 0.1 * matmul(a, h, a_bits=8, b_bits=8)
        return layer_norm(x + h, self.ln.normalized_shape, self.ln.weight, self.ln.bias, save=self.ln_save)


def _train(model, x, steps, fn=None):
    fn = model if fn is None else fn
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses = []
    for _ in range(steps):
        out = fn(x)
        loss = out.pow(2).mean() + out[..., 0].mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiles_without_graph_breaks_and_matches_eager():
    torch.manual_seed(0)
    eager = Block()
    compiled = Block()
    compiled.load_state_dict(eager.state_dict())
    x = torch.randn(2, 8, 32)
    # fullgraph=True turns any graph break into an error
    cfn = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    losses_c = _train(compiled, x, 3, cfn)
    losses_e = _train(eager, x, 3)
    assert losses_c[-1] < losses_c[0]
    for a, b in zip(losses_c, losses_e):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b))
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_dropout_seed_is_a_graph_break_but_trains():
    torch.manual_seed(0)
    model = Block(p_drop=0.1, ln_save="topk")
    x = torch.randn(2, 8, 32)
    from torch._dynamo.utils import counters

    counters.clear()
    cfn = torch.compile(model, backend="aot_eager")
    losses = _train(model, x, 3, cfn)
    assert all(torch.isfinite(torch.tensor(losses)))
    breaks = counters["graph_break"]
    assert breaks and any("item" in reason for reason in breaks), dict(breaks)


@pytest.mark.slow
def test_inductor():
    torch.manual_seed(0)
    eager, compiled = Block(), Block()
    compiled.load_state_dict(eager.state_dict())
    x = torch.randn(2, 8, 32)
    cfn = torch.compile(compiled, fullgraph=True)
    losses_c = _train(compiled, x, 3, cfn)
    losses_e = _train(eager, x, 3)
    for a, b in zip(losses_c, losses_e):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b))
