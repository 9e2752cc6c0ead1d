"""torch.compile of a small block built from slimfit's autograd functions.

Recorded in docs/autograd.md: with nearest rounding the block compiles to one graph with no break,
dropout included (its seed is a tensor drawn inside the graph); slimfit.compile compiles a patched
model layer by layer so that the scheduler's requires_grad flips do not recompile it every step.
"""
import pytest
import torch
import torch._dynamo
from _grad_utils import single_thread  # noqa: F401  (autouse fixture)
from torch import nn

from slimfit.autograd import dropout, gelu, layer_norm, linear, matmul


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


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("mode", ["seed", "bitmask"])
def test_dropout_compiles_in_one_graph_no_recompile_when_the_seed_changes(mode):
    """The seed is a tensor drawn inside the graph (no .item(), nothing guarded by value): fullgraph
    compiles, steps 2..N reuse step 1's graph, and the run equals eager (same generator draws)."""
    torch.manual_seed(0)
    eager, compiled = Block(p_drop=0.3, ln_save="topk"), Block(p_drop=0.3, ln_save="topk")
    _assert_compiles_once_and_matches_eager(eager, compiled, torch.randn(2, 8, 32))


def _assert_compiles_once_and_matches_eager(eager, compiled, x, steps=5):
    """fullgraph compile; steps 2..N add no graph; the losses equal eager's under the same generator
    draws, and change from step to step (fresh dropout masks)."""
    compiled.load_state_dict(eager.state_dict())
    cfn = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    torch.manual_seed(1)
    losses_c = _train(compiled, x, 1, cfn)
    after_first = _graphs()
    losses_c += _train(compiled, x, steps - 1, cfn)
    assert _graphs() == after_first, "a later step recompiled"
    torch.manual_seed(1)
    losses_e = _train(eager, x, steps)
    for a, b in zip(losses_c, losses_e):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b))
    assert len(set(losses_c)) == steps


class AttentionBlock(nn.Module):
    """slimfit's materializing attention with dropout on P (or on V), Q/K/V and P at 8 bits."""

    def __init__(self, mode, d=16, heads=2):
        super().__init__()
        self.qkv, self.mode, self.heads = nn.Linear(d, 3 * d), mode, heads

    def forward(self, x):
        from slimfit.autograd import attention

        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = attention(q, k, v, dropout_p=0.3, training=True, qkv_bits=8, probs="int8", dropout_mode=self.mode)
        return o.transpose(1, 2).reshape(b, s, d)


@pytest.mark.parametrize("mode", ["seed", "on_v"])
def test_attention_dropout_compiles_once_and_matches_eager(mode):
    """The attention core's dropout seed is drawn inside the graph as for nn.Dropout: no recompile
    per step (it used to be a Python int guarded by value), masks replayed in backward."""
    torch.manual_seed(0)
    _assert_compiles_once_and_matches_eager(AttentionBlock(mode), AttentionBlock(mode), torch.randn(2, 8, 16))


def test_traced_dropout_mask_is_the_kernel_mask():
    from slimfit.autograd.dropout import _traced_seeded_dropout
    from slimfit.kernels import seeded_dropout

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for seed in (0, 7, 2**33 + 5, 2**62 - 1):
            x = torch.randn(5, 301).to(dtype)
            for p in (0.0, 0.1, 0.5, 1.0):
                assert torch.equal(_traced_seeded_dropout(x, p, torch.tensor(seed)), seeded_dropout(x, p, seed))


def test_regional_compile_does_not_recompile_when_the_frozen_set_changes():
    """slimfit.compile compiles each patched layer on its own: the scheduler's requires_grad flips
    give each layer at most two graphs, all seen within the first steps."""
    import slimfit
    from slimfit import SlimFitConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 32), nn.LayerNorm(32),
                          nn.Linear(32, 4))
    # attention off: a torch-only model would get the F.scaled_dot_product_attention router
    slimfit.patch(model, SlimFitConfig.paper().replace(attention=None))
    slimfit.compile(model, backend="aot_eager")
    x = torch.randn(8, 16)
    linears = [model[0], model[3], model[5]]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    counts = []
    for step in range(8):
        for i, lin in enumerate(linears):  # a different frozen set every step, as the scheduler does
            lin.weight.requires_grad_(bool((step >> i) & 1) or i == 2)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        counts.append(_graphs())
    # every (layer kind, flag) pair has been seen by step 4; nothing compiles after
    assert counts[4:] == [counts[4]] * 4, counts
    with pytest.raises(ValueError, match="granularity"):
        slimfit.compile(model, granularity="everything")
    with pytest.raises(ValueError, match="slimfit.patch"):
        slimfit.compile(nn.Linear(2, 2))


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
