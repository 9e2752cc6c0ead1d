"""Patched models in training: loss falls like the unpatched model, composition with the
scheduler, LoRA, gradient checkpointing and autocast, and the per-module memory report."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import slimfit  # noqa: E402
from slimfit import SlimFitConfig, memory  # noqa: E402
from slimfit.scheduler import ILSScheduler  # noqa: E402

from .tiny_models import build  # noqa: E402


def _train(model, inputs, steps=20, scheduler_rate=None, lr=3e-3):
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = ILSScheduler(model, freeze_rate=scheduler_rate, warmup_steps=0) if scheduler_rate is not None else None
    if sched is not None:
        sched.attach_optimizer(opt)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", ["bert", "vit", "gpt2", "llama"])
def test_twenty_steps_lower_the_loss_like_plain(family):
    model, inputs = build(family)
    patched = slimfit.patch(copy.deepcopy(model), SlimFitConfig.paper())
    plain = _train(model, inputs)
    slim = _train(patched, inputs)
    drop_plain = plain[0] - min(plain[-5:])
    drop_slim = slim[0] - min(slim[-5:])
    assert drop_plain > 0 and drop_slim > 0
    # memorising one batch: the compressed model gets at least 70% of the plain model's loss drop
    assert drop_slim >= 0.7 * drop_plain, (plain, slim)


def test_scheduler_composes_with_patch():
    model, inputs = build("bert")
    slimfit.patch(model, SlimFitConfig.paper())
    losses = _train(model, inputs, steps=30, scheduler_rate=0.5)
    assert min(losses[-5:]) < losses[0]


def test_memory_report_shows_savings_per_module():
    model, inputs = build("bert")
    model.eval()  # deterministic, but gradients still flow
    plain = memory.measure(model, **inputs)
    patched = slimfit.patch(copy.deepcopy(model), SlimFitConfig.paper())
    for n, p in patched.named_parameters():
        if p.dim() == 2 and "classifier" not in n:
            p.requires_grad_(False)
    slim = memory.measure(patched, **inputs)
    assert slim.total < plain.total / 2, (plain.total, slim.total)
    table = memory.report(slim, baseline=plain)
    assert "encoder" in table


def test_lora_exact_gradients_and_aggressive_memory():
    peft = pytest.importorskip("peft")
    model, inputs = build("bert")
    cfg = peft.LoraConfig(r=4, target_modules=["query", "value"], lora_dropout=0.0)
    plain = peft.get_peft_model(model, cfg)
    lora = copy.deepcopy(plain)  # same adapter initialisation
    summary = slimfit.patch(lora, SlimFitConfig.exact()).slimfit_summary
    assert any(name.endswith("base_layer") for name, kind, _ in summary.patched if kind == "linear")
    plain.eval(), lora.eval()
    # PyTorch itself saves no input for a frozen linear, so exact() saves the same bytes here...
    m_plain = memory.measure(plain, **inputs)
    assert memory.measure(lora, **inputs).total <= m_plain.total
    # ...and gives the adapters identical gradients
    plain.zero_grad(), lora.zero_grad()
    plain(**inputs).loss.backward()
    lora(**inputs).loss.backward()
    for (n, p), (_, q) in zip(plain.named_parameters(), lora.named_parameters()):
        if p.requires_grad:
            assert torch.equal(p.grad, q.grad), n
    # compressing what the adapters and the frozen network keep is where LoRA users save
    squeezed = copy.deepcopy(plain)
    slimfit.patch(squeezed, SlimFitConfig.aggressive())
    squeezed.eval()
    assert memory.measure(squeezed, **inputs).total < 0.6 * m_plain.total


def test_gradient_checkpointing_non_reentrant():
    model, inputs = build("bert")
    patched = slimfit.patch(copy.deepcopy(model), SlimFitConfig.exact())
    patched.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.eval(), patched.eval()
    model(**inputs).loss.backward()
    patched(**inputs).loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), patched.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_autocast_bf16_training_step(family):
    model, inputs = build(family)
    slimfit.patch(model, SlimFitConfig.paper())
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**inputs).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_generic_fallback_on_custom_module():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    ref = copy.deepcopy(model).eval()
    summary = slimfit.patch(model, SlimFitConfig.paper()).slimfit_summary
    assert summary.family == "generic"
    kinds = {kind for _, kind, _ in summary.patched}
    assert {"linear", "gelu", "dropout", "layernorm"} <= kinds
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    model.train()
    model(x).sum().backward()
    assert model[0].weight.grad is not None
