"""slimfit.memory: bytes autograd saves for backward, per module, parameters excluded,
shared storages counted once."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slimfit.autograd import dropout, gelu, layer_norm, linear
from slimfit.memory import SavedMemory, measure, report, saved_bytes


@pytest.fixture(autouse=True)
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def nbytes(t):
    return t.numel() * t.element_size()


def total(out):
    """The explicit loss of a measurement whose forward returns a plain tensor (measure makes none up)."""
    return out.sum()


def test_parameters_excluded_input_counted():
    lin = nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    reached = []
    lin.weight.register_hook(lambda g: reached.append(g))
    run = measure(lin, x, loss_fn=total)
    assert run.total == nbytes(x)  # the input, kept for the weight gradient
    assert run.excluded == nbytes(lin.weight)  # the weight, kept for the input gradient
    assert len(reached) == 1 and lin.weight.grad is None  # backward ran; its gradient was dropped


def test_buffers_excluded():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("s", torch.full((16,), 2.0))

        def forward(self, x):
            return x * self.s  # saves the buffer (grad of x) only

    x = torch.randn(4, 16, requires_grad=True)
    run = measure(Scale(), x, loss_fn=total)
    assert run.total == 0 and run.excluded == 16 * 4


def test_shared_storage_counted_once():
    x = torch.randn(8, 32, requires_grad=True)
    assert saved_bytes(lambda x: x * x, x) == nbytes(x)  # x saved twice
    assert saved_bytes(lambda x: x.sin() + x.cos(), x) == nbytes(x)
    # two views of one storage: the whole storage is kept alive, once
    assert saved_bytes(lambda x: x[:, :16] * x[:, 16:], x) == nbytes(x)
    y = torch.randn(8, 32, requires_grad=True)
    assert saved_bytes(lambda x, y: x * y, x, y) == nbytes(x) + nbytes(y)


def test_per_module_attribution_plain_sequential():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(5, 16)
    run = measure(model, x, loss_fn=total)
    n_hidden = 5 * 32 * 4
    # x does not require grad but the first weight does: Linear 0 keeps x
    assert run.per_module == {"0": 5 * 16 * 4, "1": n_hidden, "2": n_hidden}
    assert run.total == sum(run.per_module.values())
    assert run.counts == {"0": 1, "1": 1, "2": 1}
    assert run["missing"] == 0
    for m in model.modules():  # hooks removed
        assert not m._forward_hooks and not m._forward_pre_hooks


class SlimMLP(nn.Module):
    """A block built from slimfit functions, sharing nn.Linear / nn.LayerNorm parameters."""

    def __init__(self, d=128, h=256):
        super().__init__()
        self.fc1, self.fc2, self.ln = nn.Linear(d, h), nn.Linear(h, d), nn.LayerNorm(d)
        self.fc1.weight.requires_grad_(False)

    def forward(self, x):
        y = gelu(linear(x, self.fc1.weight, self.fc1.bias), bits=4)
        y = dropout(linear(y, self.fc2.weight, self.fc2.bias, input_bits=8), 0.1)
        return layer_norm(x + y, self.ln.normalized_shape, self.ln.weight, self.ln.bias, save="int8")


def test_nested_paths_and_slimfit_block_bytes():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("block", SlimMLP())
    model.add_module("head", nn.Linear(128, 4))
    x = torch.randn(2, 8, 128, requires_grad=True)
    run = measure(model, x, loss_fn=total)
    n_h, n_d, rows = 16 * 256, 16 * 128, 16

    def q(n, bits):
        return -(-n * bits // 8) + 8 * -(-n // 128)

    # block: GELU input 4-bit, fc2 input 8-bit, no dropout mask, LayerNorm x_hat int8 + rstd
    assert run.per_module["block"] == q(n_h, 4) + q(n_h, 8) + q(n_d, 8) + 4 * rows
    assert run.per_module["head"] == n_d * 4  # plain nn.Linear keeps its fp32 input
    assert set(run.per_module) == {"block", "head"}


def test_report_with_baseline():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))

    class Slim(nn.Module):
        def __init__(self, ref):
            super().__init__()
            self.ref = ref

        def forward(self, x):
            h = linear(x, self.ref[0].weight, self.ref[0].bias, input_bits=8)
            return linear(gelu(h, bits=4), self.ref[2].weight, self.ref[2].bias, input_bits=8)

    x = torch.randn(32, 64)
    base = measure(plain, x, loss_fn=total)
    slim = measure(Slim(plain), x, loss_fn=total)
    assert slim.total < base.total / 3
    text = report(slim, baseline=base)
    lines = text.splitlines()
    assert lines[0].split() == ["module", "saved", "share", "baseline", "reduction"]
    assert any(line.startswith("total") for line in lines)
    assert f"{base.total / slim.total:.2f}x" in text
    assert "0" in text and "(root)" in text
    solo = report(base)
    assert "baseline" not in solo and "100.0%" in solo
    assert str(base) == solo


def test_callable_with_closure_parameters_and_exclude():
    w = nn.Parameter(torch.randn(8, 16))
    x = torch.randn(4, 16, requires_grad=True)
    run = measure(lambda x: F.linear(x, w), x, loss_fn=total)
    assert run.total == nbytes(x) and run.excluded == nbytes(w)
    w2 = torch.randn(8, 16, requires_grad=True)  # a plain tensor: counted unless excluded

    def f(x):
        return F.linear(x, w2)

    assert measure(f, x, loss_fn=total).total == nbytes(x) + nbytes(w2)
    assert measure(f, x, loss_fn=total, exclude=[w2]).total == nbytes(x)


def test_loss_fn_and_model_output_with_loss():
    @dataclasses.dataclass
    class Output:
        loss: torch.Tensor
        logits: torch.Tensor

    lin = nn.Linear(16, 3)
    x = torch.randn(4, 16)
    target = torch.tensor([0, 1, 2, 0])

    def model(x):
        logits = lin(x)
        return Output(F.cross_entropy(logits, target), logits)

    grads = []  # what backward delivers to the weight (measure drops it: .grad stays None)
    lin.weight.register_hook(lambda g: grads.append(g))
    run = measure(model, x)
    assert len(grads) == 1 and run.total > 0
    measure(lin, x, loss_fn=lambda out: out.pow(2).mean())
    expected = torch.autograd.grad(lin(x).pow(2).mean(), lin.weight)[0]
    assert len(grads) == 3 and torch.equal(grads[1], expected)
    measure(lin, x, backward=False)
    assert len(grads) == 3 and lin.weight.grad is None


def test_kwargs_forwarded_and_nothing_saved_without_grad():
    x = torch.randn(4, 16)
    assert measure(F.gelu, x, approximate="tanh", backward=False).total == 0  # nothing requires grad
    xg = x.requires_grad_()
    assert measure(F.gelu, xg, approximate="tanh", backward=False).total == nbytes(xg)
    run = SavedMemory()
    assert run.total == 0 and report(run).splitlines()[-1].split()[0] == "total"


def test_measure_leaves_no_grad_behind():
    """The backward measure runs computes gradients and drops them: no `.grad` is set or changed
    (parameters of the model, of closures, and inputs)."""
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    x = torch.randn(4, 8, requires_grad=True)
    net[0].weight.grad = torch.ones_like(net[0].weight)  # an accumulated gradient must survive
    run = measure(net, x, loss_fn=total)
    assert run.total > 0
    assert torch.equal(net[0].weight.grad, torch.ones_like(net[0].weight))
    assert all(p.grad is None for n, p in net.named_parameters() if n != "0.weight")
    assert x.grad is None
    measure(lambda a: net(a).sum(), x)
    assert x.grad is None and net[2].weight.grad is None


def test_measure_refuses_the_meta_device():
    with torch.device("meta"):
        net = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="meta device"):
        measure(net, torch.randn(2, 4))
    with pytest.raises(ValueError, match="meta device"):
        measure(lambda a: a.tanh(), torch.randn(2, 4, device="meta", requires_grad=True))


# ------------------------------------------------------------------ no loss is made up (issue #30)
def _tiny_bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=3)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg)
    model.eval()  # no dropout: the two measurements below see the same forward
    return model, {"input_ids": torch.randint(4, 50, (2, 8))}


def test_hugging_face_model_without_labels_is_refused():
    """output.loss is None: a training step's number would miss the loss's bytes and backward has
    nothing to run on. Refused, naming the fixes; each fix works."""
    model, inputs = _tiny_bert()
    with pytest.raises(ValueError, match=r"output\.loss is None.*labels.*loss_fn=.*backward=False"):
        measure(model, **inputs)
    forward_only = measure(model, **inputs, backward=False)  # the explicit forward-only measurement
    step = measure(model, **inputs, labels=torch.tensor([0, 2]))
    # the cross-entropy keeps its log-probabilities: the number the implicit loss reported was short
    assert step.total > forward_only.total
    # loss_fn: backward runs on the given loss, computed after the measured forward (its bytes not counted)
    reached = []
    model.classifier.weight.register_hook(lambda g: reached.append(g))
    target = torch.tensor([0, 2])
    run = measure(model, **inputs, loss_fn=lambda out: F.cross_entropy(out.logits, target))
    assert run.total == forward_only.total and len(reached) == 1


def test_output_without_loss_is_refused_not_summed():
    lin = nn.Linear(16, 3)
    x = torch.randn(4, 16)
    reached = []
    lin.weight.register_hook(lambda g: reached.append(g))
    for fn in (lambda a: (lin(a), lin(a).relu()), lin, lambda a: {"logits": lin(a)}):
        with pytest.raises(ValueError, match=r"has no loss.*loss_fn=.*backward=False"):
            measure(fn, x)
    assert reached == []  # no backward ran on a made-up loss
    assert measure(lambda a: (lin(a), lin(a)), x, backward=False).total == nbytes(x)  # explicit forward only
    assert measure(lambda a: lin(a).sum(), x).total == nbytes(x) and len(reached) == 1  # a scalar is the loss


def test_unusable_loss_is_refused():
    lin = nn.Linear(16, 3)
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="loss_fn\\(output\\) must be a one-element floating tensor"):
        measure(lin, x, loss_fn=lambda out: out * 2)  # not reduced to a loss
    lin.requires_grad_(False)
    with pytest.raises(ValueError, match="does not require grad.*backward=False"):
        measure(lin, x, loss_fn=total)  # nothing trains: a training step has no backward
    assert measure(lin, x, backward=False).total == 0
