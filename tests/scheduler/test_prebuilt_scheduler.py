"""A scheduler built before the optimizer (or the Trainer) must not keep layers out of training.

Regression for: ``ILSScheduler(model, 0.9)`` froze 90% of the layers at construction, so an
optimizer built afterwards from ``p.requires_grad`` (as Trainer and the common
``AdamW(p for p in model.parameters() if p.requires_grad)`` do) never held them: 1 of 40
pretrained weight matrices moved in 10 steps, silently.
"""
import warnings

import pytest
import torch
from _models import bert_batch, tiny_bert

from slimfit.scheduler import ILSScheduler


def _moved_weight_matrices(model, before):
    return sum(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.dim() == 2)


def _train(model, sched, optimizer, steps=10):
    batch = bert_batch()
    for _ in range(steps):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sched.step()


def test_optimizer_built_after_the_scheduler_from_requires_grad_holds_every_layer():
    model = tiny_bert()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    n_matrices = sum(p.dim() == 2 for p in model.parameters())
    sched = ILSScheduler(model, 0.9, warmup_steps=0)
    # Nothing is frozen until training starts ...
    assert all(p.requires_grad for p in model.parameters())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    sched.attach_optimizer(opt)
    # ... and the decision made at construction is in force from the first step on.
    assert sched.num_frozen == sum(not p.requires_grad for p in sched.params) > 0
    _train(model, sched, opt, steps=16)   # 14 scheduled matrices, 1 trains per step: the round robin takes 14
    assert _moved_weight_matrices(model, before) == n_matrices


def test_first_forward_applies_the_frozen_set():
    model = tiny_bert()
    sched = ILSScheduler(model, 0.9, warmup_steps=0)
    frozen = set(sched.frozen_names())
    model(**bert_batch())
    params = dict(model.named_parameters())
    assert {n for n in sched.names if not params[n].requires_grad} == frozen


def test_attach_optimizer_of_another_model_is_refused():
    model, other = tiny_bert(), tiny_bert(seed=1)
    sched = ILSScheduler(model, 0.9)
    with pytest.raises(ValueError, match="holds none of the"):
        sched.attach_optimizer(torch.optim.AdamW(other.parameters()))


def test_attach_optimizer_missing_some_layers_warns():
    model = tiny_bert()
    sched = ILSScheduler(model, 0.5, warmup_steps=0)
    sched.apply()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with pytest.warns(UserWarning, match="never train"):
        sched.attach_optimizer(opt)


def test_step_warns_when_the_attached_optimizer_never_steps():
    model = tiny_bert()
    sched = ILSScheduler(model, 0.5, optimizer=torch.optim.AdamW(model.parameters()))
    with pytest.warns(UserWarning, match="never stepped"):
        for _ in range(10):
            sched.step()
    assert sched.skipped_steps == 10


def test_gradient_accumulation_does_not_warn():
    model = tiny_bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = ILSScheduler(model, 0.5, optimizer=opt)
    batch = bert_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _step in range(3):
            for _ in range(12):          # micro-batches: step() per micro-batch is tolerated
                model(**batch).loss.backward()
                sched.step()
            opt.step()
            opt.zero_grad()
            sched.step()
    assert sched.step_count == 3


def test_trainer_with_prebuilt_scheduler_trains_every_layer(tmp_path):
    from test_callback import _DS
    from transformers import Trainer, TrainingArguments

    from slimfit.scheduler import SlimFitCallback

    model = tiny_bert()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    n_matrices = sum(p.dim() == 2 for p in model.parameters())
    cb = SlimFitCallback(scheduler=ILSScheduler(model, 0.9, warmup_steps=0))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=16, per_device_train_batch_size=8,
                             learning_rate=1e-2, use_cpu=True, report_to=[], save_strategy="no",
                             logging_steps=4, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=_DS(), callbacks=[cb])
    trainer.train()
    held = sum(len(g["params"]) for g in trainer.optimizer.param_groups)
    assert held == len(list(model.parameters()))
    assert _moved_weight_matrices(model, before) == n_matrices
    shares = [h["slimfit_frozen_share"] for h in trainer.state.log_history if "slimfit_frozen_share" in h]
    assert shares and all(0.85 < s < 0.95 for s in shares)
    assert cb.scheduler.closed and all(p.requires_grad for p in model.parameters())


def test_trainer_callback_with_config_patches_and_schedules(tmp_path):
    from test_callback import _DS
    from transformers import Trainer, TrainingArguments

    import slimfit
    from slimfit.scheduler import SlimFitCallback

    model = tiny_bert()
    cb = SlimFitCallback(config=slimfit.SlimFitConfig.paper(), freeze_rate=0.8, warmup_steps=0)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8,
                             learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no",
                             disable_tqdm=True, seed=0, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=_DS(), callbacks=[cb])
    assert "SlimFit" in type(model.bert.encoder.layer[0].intermediate.dense).__name__  # patched at init
    trainer.train()
    assert cb.scheduler.step_count == 3


def test_a_dropped_scheduler_freezes_nothing_later_and_the_model_pickles():
    import gc
    import pickle

    model = tiny_bert()
    sched = ILSScheduler(model, 0.9, warmup_steps=0)
    assert sched.num_frozen > 0
    del sched
    gc.collect()
    model(**bert_batch())
    assert all(p.requires_grad for p in model.parameters())

    kept = ILSScheduler(model, 0.9, warmup_steps=0)
    clone = pickle.loads(pickle.dumps(model))       # the pending hook pickles as a no-op
    clone(**bert_batch())
    assert all(p.requires_grad for p in clone.parameters())
    model(**bert_batch())
    assert sum(not p.requires_grad for p in model.parameters()) == kept.num_frozen
