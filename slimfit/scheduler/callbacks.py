"""Hugging Face ``transformers.Trainer`` integration.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[SlimFitCallback(freeze_rate=0.9)])

The callback builds the scheduler in ``on_train_begin`` — after the Trainer has created the
optimizer and wrapped the model (DDP included), as DDP requires — attaches the optimizer,
and calls ``scheduler.step()`` in ``on_step_end``, i.e. once per optimizer update (after
gradient accumulation). Pass a ready ``scheduler=`` instead to control construction.

Checkpoints: ``on_save`` writes ``slimfit_ils.pt`` into the checkpoint folder; when the
Trainer resumes (``state.global_step > 0`` at ``on_train_begin``), the callback loads it
from ``<output_dir>/checkpoint-<global_step>`` (or from ``resume_from=``), after the Trainer
has restored the model weights, so the resumed run makes the same decisions.

Under DDP set ``TrainingArguments(ddp_find_unused_parameters=True)`` (see ``ddp.py``).

This module imports ``transformers``; ``slimfit.scheduler`` exposes ``SlimFitCallback``
lazily, so the scheduler itself works without transformers installed.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from transformers import TrainerCallback

from .ils import ILSScheduler

__all__ = ["SlimFitCallback", "STATE_FILE"]

STATE_FILE = "slimfit_ils.pt"


class SlimFitCallback(TrainerCallback):
    """Steps an :class:`ILSScheduler` inside ``transformers.Trainer``.

    Args:
        scheduler: an existing scheduler (else one is built from the model at train begin).
        resume_from: a checkpoint folder to load the scheduler state from.
        **scheduler_kwargs: arguments of :class:`ILSScheduler` (freeze_rate, score, ...).
    """

    def __init__(self, scheduler: Optional[ILSScheduler] = None, resume_from: Optional[str] = None,
                 **scheduler_kwargs):
        if scheduler is not None and scheduler_kwargs:
            raise TypeError("pass either scheduler= or ILSScheduler arguments, not both")
        self.scheduler = scheduler
        self.resume_from = resume_from
        self.scheduler_kwargs = scheduler_kwargs

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.scheduler is None:
            if model is None:
                raise RuntimeError("SlimFitCallback: the Trainer passed no model to on_train_begin")
            self.scheduler = ILSScheduler(model, **self.scheduler_kwargs)
        if optimizer is not None:
            self.scheduler.attach_optimizer(optimizer)
        path = self.resume_from
        if path is None and state.global_step > 0:
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if path is not None:
            f = os.path.join(path, STATE_FILE)
            if os.path.isfile(f):
                self.scheduler.load_state_dict(torch.load(f, map_location="cpu", weights_only=False))
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.scheduler is not None:
            self.scheduler.step()
        return control

    def on_save(self, args, state, control, **kwargs):
        if self.scheduler is None or not state.is_world_process_zero:
            return control
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(folder):
            torch.save(self.scheduler.state_dict(), os.path.join(folder, STATE_FILE))
        return control
