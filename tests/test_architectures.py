"""slimfit/architectures.py: the architectures `slimfit memory` and bench/ build from their configs."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from slimfit import architectures as archs  # noqa: E402


def test_resolve_and_catalogue():
    assert archs.resolve("ViT").name == "vit-base"
    assert archs.resolve("GPT2").name == "gpt2"
    assert archs.resolve(" BERT_tiny ").name == "bert-tiny"
    for arch in archs.ARCHITECTURES.values():
        import transformers

        assert hasattr(transformers, arch.config_class) and hasattr(transformers, arch.model_class)
    assert "bert-tiny" not in archs.known_names() and "bert-base" in archs.known_names()
    with pytest.raises(ValueError, match="known architectures: bert-base"):
        archs.resolve("bert-huge")


def test_issue14_architectures_are_listed():
    small = archs.resolve("llama-small")
    assert small.config["hidden_size"] == 256 and small.config["num_key_value_heads"] == 2
    assert small.config["vocab_size"] == 8000 and small.config["max_position_embeddings"] >= 4096
    assert archs.resolve("smollm2").name == "smollm2-135m"


def test_build_freeze_measure_one_step():
    """The path bench/ and the CLI share: build, a batch, the scheduler's first frozen set, one measured step."""
    import torch

    torch.set_num_threads(1)
    arch = archs.resolve("bert-tiny")
    model = archs.build(arch, seed=0)
    assert model.training
    inputs = archs.make_inputs(model, arch.task, batch=2, seq_len=8, seed=0)
    assert inputs["input_ids"].shape == (2, 8) and int(inputs["input_ids"].min()) >= 4
    frozen, candidates = archs.scheduler_frozen_set(model, 0.5, seed=0)
    assert frozen and set(frozen) < set(candidates)
    assert all(p.requires_grad for p in model.parameters())  # the frozen set is only returned
    plain = archs.measure_step(model, inputs, name="plain")
    archs.set_frozen(model, frozen)
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == set(frozen)
    run = archs.measure_step(model, inputs, name="frozen")
    assert 0 < run.total < plain.total and run.name == "frozen"
    assert all(p.grad is None for p in model.parameters())
    collapsed = archs.collapse_layers(run)
    assert collapsed.total == run.total and any(".layer.*." in k for k in collapsed.per_module)


def test_step_peak_with_adamw_state_made_first():
    """measure_step_peak: the whole step (AdamW at lr 0, its moments made beforehand by prime_optimizer), the
    weights untouched, nothing left behind."""
    import torch

    torch.set_num_threads(1)
    arch = archs.resolve("bert-tiny")
    model = archs.build(arch, seed=0)
    inputs = archs.make_inputs(model, arch.task, batch=2, seq_len=8, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    archs.set_frozen(model, [n for n, p in model.named_parameters() if p.dim() == 2 and ".layer.0." in n])
    opt = archs.adamw(model)
    archs.prime_optimizer(opt)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(opt.state[p] for p in trainable) and len(opt.state) == len(trainable)
    assert all(p.grad is None for p in model.parameters())
    state = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values())
    run = archs.measure_step_peak(model, inputs, optimizer=opt, name="frozen")
    assert run.name == "frozen" and run.optimizer_state == state and run.resident > state
    assert sum(run.parts().values()) == run.total > run.resident
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # lr 0
    assert all(p.grad is None for p in model.parameters())
    default = archs.measure_step_peak(model, inputs)  # its own AdamW: the same step
    assert default.total == run.total


def test_priming_makes_the_state_of_layers_the_scheduler_froze():
    """Under the scheduler every layer has trained at some step and keeps its AdamW state while frozen; the
    scheduler's guard drops frozen layers' gradients before a step, so priming must not go through it."""
    import torch

    from slimfit.scheduler import ILSScheduler

    arch = archs.resolve("bert-tiny")
    model = archs.build(arch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    scheduler = ILSScheduler(model, freeze_rate=0.7, seed=0, warmup_steps=0)
    scheduler.attach_optimizer(optimizer)
    assert scheduler.num_frozen > 0
    archs.prime_optimizer(optimizer)
    assert all(optimizer.state.get(p) for p in model.parameters())
    assert not any(p.grad is not None for p in model.parameters())
