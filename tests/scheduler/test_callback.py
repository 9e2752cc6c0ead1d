"""transformers.Trainer integration, and the scheduler without transformers."""
import os
import sys

import pytest
import torch
from _models import bert_batch, tiny_bert

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_scheduler_works_without_transformers(monkeypatch):
    import slimfit.scheduler as S

    monkeypatch.setitem(sys.modules, "transformers", None)           # import transformers -> ImportError
    monkeypatch.delitem(sys.modules, "slimfit.integrations.trainer", raising=False)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    s = S.ILSScheduler(m, freeze_rate=0.5)
    s.step()
    with pytest.raises(ImportError):
        _ = S.SlimFitCallback


def test_scheduler_modules_do_not_import_kernels_or_autograd():
    import ast
    import pathlib

    folder = pathlib.Path(ROOT, "slimfit", "scheduler")
    for f in folder.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [("." * node.level) + (node.module or "")]
            for mname in mods:
                assert not any(x in mname for x in ("kernels", "autograd", "..")), (f.name, mname)
                if f.name != "callbacks.py":
                    assert "transformers" not in mname, (f.name, mname)


class _DS(torch.utils.data.Dataset):
    def __init__(self, n=32):
        b = bert_batch(n=n)
        self.items = [{k: v[i] for k, v in b.items()} for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _trainer(tmp, callbacks, max_steps=4):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp), max_steps=max_steps, per_device_train_batch_size=8,
                             learning_rate=2e-3, weight_decay=0.01, use_cpu=True, report_to=[],
                             save_strategy="steps", save_steps=2, save_only_model=False,
                             logging_steps=1000, disable_tqdm=True, seed=0, data_seed=0,
                             dataloader_num_workers=0)
    return Trainer(model=tiny_bert(), args=args, train_dataset=_DS(), callbacks=callbacks)


def test_trainer_callback_steps_freezes_and_resumes(tmp_path):
    from transformers import TrainerCallback

    from slimfit.integrations.trainer import STATE_FILE
    from slimfit.scheduler import SlimFitCallback

    class Check(TrainerCallback):
        """Runs before SlimFitCallback: frozen weights unchanged over each optimizer step."""

        def __init__(self, ils):
            self.ils, self.log, self.before = ils, [], None

        def on_step_begin(self, args, state, control, model=None, **kw):
            s = self.ils.scheduler
            self.before = {n: p.detach().clone() for n, p in zip(s.names, s.params) if not p.requires_grad}
            self.log.append(tuple(s.frozen_names()))

        def on_step_end(self, args, state, control, model=None, **kw):
            s = self.ils.scheduler
            for n, p in zip(s.names, s.params):
                if n in self.before:
                    assert torch.equal(p, self.before[n]), n

    ils = SlimFitCallback(freeze_rate=0.8, warmup_steps=0)
    check = Check(ils)
    trainer = _trainer(tmp_path, [check, ils])
    trainer.train()
    s = ils.scheduler
    assert s.step_count == 4 and len(check.log) == 4
    assert all(len(f) == 10 for f in check.log)   # round(0.8 * 13): embeddings, norms and the head are not scheduled
    # training over: the callback unfroze every layer
    assert s.closed and s.num_frozen == 0 and all(p.requires_grad for p in s.params)
    assert os.path.isfile(tmp_path / "checkpoint-2" / STATE_FILE)

    # resume from step 2: the scheduler state comes back and steps 3-4 freeze the same layers
    ils2 = SlimFitCallback(freeze_rate=0.8, warmup_steps=0)
    check2 = Check(ils2)
    trainer2 = _trainer(tmp_path, [check2, ils2])
    trainer2.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert check2.log == check.log[2:]
    assert ils2.scheduler.step_count == 4
