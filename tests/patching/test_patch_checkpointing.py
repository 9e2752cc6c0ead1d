"""Gradient checkpointing with dropout: the first pass and the recompute must draw the same masks.

Reentrant checkpointing (torch.utils.checkpoint(..., use_reentrant=True), HF's
gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})) runs the
first pass under torch.no_grad and the recompute with gradients; both must use slimfit's seeded
mask (the RNG state is restored for the recompute), else the gradient belongs to another network.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import slimfit  # noqa: E402
from slimfit import SlimFitConfig  # noqa: E402

from .tiny_models import TEXT, _text_inputs  # noqa: E402


def _bert(config):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(**TEXT, num_labels=2, hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3)
    model = transformers.BertForSequenceClassification(cfg)
    slimfit.patch(model, config)
    model.train()
    inputs = _text_inputs()
    inputs["labels"] = torch.tensor([0, 1, 1])
    return model, inputs


def _loss_and_grads(model, inputs, seed=5):
    torch.manual_seed(seed)
    loss = model(**inputs).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


CONFIGS = {
    "exact": SlimFitConfig.exact(),
    "paper": SlimFitConfig.paper(),
    # draws made only while a graph is built (stochastic rounding, row sampling) must not shift the
    # dropout seeds of the recompute (slimfit/autograd/seeds.py)
    "paper-stochastic": SlimFitConfig.paper().replace(stochastic=True),
    "wta_crs": SlimFitConfig.wta_crs(),
}


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore:slimfit. sampling .SlimFitConfig.sampling. runs without")
@pytest.mark.parametrize("preset", list(CONFIGS))
@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_gives_the_gradients_of_the_plain_run(preset, reentrant):
    model, inputs = _bert(CONFIGS[preset])
    if preset != "exact":  # 90% frozen as under the scheduler: the frozen fast paths run too
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        for m in linears[: int(0.9 * len(linears))]:
            m.weight.requires_grad_(False)
    loss_plain, grads_plain = _loss_and_grads(model, inputs)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    loss_ckpt, grads_ckpt = _loss_and_grads(model, inputs)
    assert loss_ckpt == pytest.approx(loss_plain, rel=1e-6, abs=1e-7)
    assert grads_ckpt.keys() == grads_plain.keys() and grads_plain
    for name, g in grads_plain.items():
        torch.testing.assert_close(grads_ckpt[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_dropout_mask_is_seeded_under_no_grad_when_training():
    """The no-grad forward of a training dropout uses the seeded mask a grad-enabled forward uses."""
    model, inputs = _bert(SlimFitConfig.exact())
    drop = model.bert.encoder.layer[0].output.dropout
    x = torch.randn(4, 64)
    torch.manual_seed(3)
    with torch.no_grad():
        a = drop(x)
    torch.manual_seed(3)
    b = drop(x.requires_grad_())
    assert torch.equal(a, b.detach())


def test_plain_torch_checkpoint_with_functional_dropout():
    """torch.utils.checkpoint around slimfit.dropout itself (not a patched module)."""
    from slimfit.autograd import dropout

    lin = torch.nn.Linear(16, 16)

    def block(x):
        return lin(dropout(torch.tanh(x), 0.5))

    x = torch.randn(8, 16, requires_grad=True)
    torch.manual_seed(1)
    block(x).pow(2).sum().backward()
    g_plain, gw_plain = x.grad.clone(), lin.weight.grad.clone()
    x.grad = None
    lin.weight.grad = None
    for reentrant in (True, False):
        torch.manual_seed(1)
        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant).pow(2).sum().backward()
        torch.testing.assert_close(x.grad, g_plain, rtol=0, atol=0)
        torch.testing.assert_close(lin.weight.grad, gw_plain, rtol=0, atol=0)
        x.grad = None
        lin.weight.grad = None
