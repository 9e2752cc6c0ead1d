"""The scheduler's default always_train: a task model's fresh head trains every step; models without one
(and explicit layer lists) are scheduled whole; always_train=() restores SlimFit's rule."""
import pytest
import torch
from _models import MLP, bert_batch, tiny_bert
from torch import nn

from slimfit.scheduler import ILSScheduler
from slimfit.scheduler.candidates import find_task_heads


def test_the_head_of_a_task_model_trains_every_step_by_default():
    torch.manual_seed(0)
    model = tiny_bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = ILSScheduler(model, 0.9, optimizer=opt, warmup_steps=0)
    assert sched.always_train == ("classifier",)
    assert not any(n.startswith("classifier") for n in sched.names)
    batch = bert_batch()
    for _ in range(5):
        before = model.classifier.weight.detach().clone()
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        assert model.classifier.weight.requires_grad
        assert not torch.equal(before, model.classifier.weight.detach())   # moved at every step


def test_an_empty_always_train_schedules_the_head_like_any_layer():
    model = tiny_bert()
    default = ILSScheduler(model, 0.7)
    slimfit_rule = ILSScheduler(model, 0.7, always_train=())
    assert slimfit_rule.always_train == ()
    assert set(slimfit_rule.names) - set(default.names) == {"classifier.weight"}


def test_models_without_a_head_and_explicit_layers_are_scheduled_whole():
    mlp = MLP()
    assert ILSScheduler(mlp, 0.5).names == ILSScheduler(mlp, 0.5, always_train=()).names
    assert ILSScheduler(mlp, 0.5).always_train == ()
    encoder = tiny_bert().bert                                  # a bare encoder: no head
    assert ILSScheduler(encoder, 0.5).always_train == ()
    model = tiny_bert()
    listed = ["bert.encoder.layer.0.attention.self.query.weight", "classifier.weight"]
    assert ILSScheduler(model, 0.5, layers=listed).names == listed
    # Parameter pairs carry no module structure: nothing is guessed from names.
    pairs = ILSScheduler(list(model.named_parameters()), 0.5)
    assert "classifier.weight" in pairs.names and pairs.always_train == ()


def test_a_head_that_is_all_there_is_or_frozen_is_not_left_out():
    only_head = nn.Sequential()
    only_head.add_module("classifier", nn.Linear(4, 2))
    assert ILSScheduler(only_head, 0.0).names == ["classifier.weight"]
    model = tiny_bert()
    model.classifier.requires_grad_(False)                      # the user froze the head: no candidate
    sched = ILSScheduler(model, 0.7)
    assert sched.always_train == () and not any(n.startswith("classifier") for n in sched.names)


def test_the_head_is_found_through_compile_and_peft_wrappers():
    compiled = torch.compile(tiny_bert())
    assert find_task_heads(compiled) == ["_orig_mod.classifier"]
    sched = ILSScheduler(compiled, 0.7)
    assert sched.always_train == ("_orig_mod.classifier",)
    assert not any(".classifier." in n for n in sched.names)
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(tiny_bert(), peft.LoraConfig(r=2, target_modules=["query", "value"],
                                                            modules_to_save=["classifier"]))
    sched = ILSScheduler(lora, 0.5)
    assert sched.always_train == ("base_model.model.classifier",)
    assert sched.names and all("lora_" in n for n in sched.names)


def test_a_state_that_scheduled_the_head_says_how_to_resume_it():
    model = tiny_bert()
    old = ILSScheduler(model, 0.7, always_train=()).state_dict()
    with pytest.raises(ValueError, match=r"always_train=\(\) to resume"):
        ILSScheduler(model, 0.7).load_state_dict(old)
    ILSScheduler(model, 0.7, always_train=()).load_state_dict(old)
