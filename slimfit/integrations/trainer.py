"""Hugging Face ``transformers.Trainer`` integration.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[SlimFitCallback(freeze_rate=0.7)])

The callback builds the scheduler in ``on_train_begin`` — after the Trainer has created the
optimizer and wrapped the model (DDP included), as DDP requires — from its options (keywords, or
``scheduler=SchedulerConfig(...)``; checked when the callback is built), attaches the optimizer,
and calls ``scheduler.step()`` in ``on_step_end``, i.e. once per optimizer update (after
gradient accumulation). Pass a ready ``scheduler=ILSScheduler(...)`` instead to control construction: a
scheduler freezes nothing until training starts, so an optimizer the Trainer builds from
``requires_grad`` still holds every layer (attach_optimizer raises or warns if it does not).

``config=`` (a ``slimfit.SlimFitConfig``) also patches the model when the Trainer is built
(``on_init_end``), so one callback does everything. Each logging step adds
``slimfit_frozen_share`` (share of scheduled layers frozen, mean since the last log) to the
Trainer's logs, and ``on_train_end`` unfreezes every layer (``scheduler.close()``).

Checkpoints: ``on_save`` writes ``slimfit_ils.pt`` into the checkpoint folder; when the
Trainer resumes (``state.global_step > 0`` at ``on_train_begin``), the callback loads it
from ``<output_dir>/checkpoint-<global_step>`` (or from ``resume_from=``), after the Trainer
has restored the model weights, so the resumed run makes the same decisions. A ``resume_from=`` folder
without the file is an error; a Trainer checkpoint without it warns (the schedule starts afresh).

Under DDP set ``TrainingArguments(ddp_find_unused_parameters=True)`` (see ``ddp.py``).

This module imports ``transformers``, and the patch layer when ``config=`` asks for a patch; it sits at
the edge (``slimfit.integrations``), above both the scheduler and the patch. ``slimfit.scheduler`` exposes
``SlimFitCallback`` lazily, so the scheduler itself works without transformers installed.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional, Union

import torch
from transformers import TrainerCallback

from ..config import SlimFitConfig
from ..patching import patch
from ..scheduler.candidates import unwrap_model
from ..scheduler.config import SchedulerConfig
from ..scheduler.ils import ILSScheduler

__all__ = ["SlimFitCallback", "STATE_FILE"]

STATE_FILE = "slimfit_ils.pt"


def _check_patch_config(config) -> None:
    """``config=`` is the patch's SlimFitConfig (None: the model is not patched)."""
    if config is None:
        return
    if isinstance(config, SchedulerConfig):
        raise TypeError("config= is the SlimFitConfig that patches the model; pass a SchedulerConfig as "
                        "SlimFitCallback(scheduler=SchedulerConfig(...))")
    if not isinstance(config, SlimFitConfig):
        raise TypeError(f"config must be a slimfit.SlimFitConfig, got {type(config).__name__}")


class SlimFitCallback(TrainerCallback):
    """Steps an :class:`ILSScheduler` inside ``transformers.Trainer``.

    Args:
        scheduler: an existing ILSScheduler, or a ``SchedulerConfig`` to build one from at train begin
            (None: the defaults). The options are checked here, when the callback is built, not hours
            later when training starts.
        resume_from: a checkpoint folder to load the scheduler state from (an error at train begin
            when it holds no slimfit_ils.pt).
        config: a ``slimfit.SlimFitConfig`` to patch the model with when the Trainer is built.
        **scheduler_kwargs: SchedulerConfig fields by name (freeze_rate, score, ...), as for
            ILSScheduler; with a SchedulerConfig they change those fields of it.
    """

    def __init__(self, scheduler: Union[ILSScheduler, SchedulerConfig, None] = None,
                 resume_from: Optional[str] = None, config=None, **scheduler_kwargs):
        if isinstance(scheduler, ILSScheduler) and scheduler_kwargs:
            raise TypeError("pass either scheduler= or ILSScheduler arguments, not both")
        if scheduler is not None and not isinstance(scheduler, (ILSScheduler, SchedulerConfig)):
            raise TypeError(f"scheduler must be an ILSScheduler or a SchedulerConfig, got {type(scheduler).__name__}")
        _check_patch_config(config)
        if resume_from is not None and not isinstance(resume_from, (str, os.PathLike)):
            raise TypeError(f"resume_from must be a checkpoint folder (a path), got {type(resume_from).__name__}")
        self.scheduler = scheduler if isinstance(scheduler, ILSScheduler) else None
        # Validated now: a bad option fails when the callback is built, not at on_train_begin.
        self.scheduler_config = (None if self.scheduler is not None
                                 else SchedulerConfig.from_options(scheduler, **scheduler_kwargs))
        self.resume_from = resume_from
        self.config = config
        self._frozen_shares: list[float] = []

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if self.config is not None and model is not None:
            patch(unwrap_model(model), self.config)
        return control

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.scheduler is None:
            if model is None:
                raise RuntimeError("SlimFitCallback: the Trainer passed no model to on_train_begin")
            self.scheduler = ILSScheduler(model, self.scheduler_config)
        if optimizer is not None:
            self.scheduler.attach_optimizer(optimizer)
        path = self.resume_from
        if path is None and state.global_step > 0:
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if path is not None:
            f = os.path.join(path, STATE_FILE)
            if os.path.isfile(f):
                self.scheduler.load_state_dict(torch.load(f, map_location="cpu", weights_only=False))
            elif self.resume_from is not None:
                raise FileNotFoundError(f"SlimFitCallback(resume_from={self.resume_from!r}): no {STATE_FILE} in "
                                        "that folder; give the checkpoint folder the callback saved into "
                                        "(checkpoint-<step>), or leave resume_from=None")
            else:
                warnings.warn(f"SlimFitCallback: the Trainer resumes at step {state.global_step} but {f} does not "
                              "exist, so the scheduler starts afresh (its decisions differ from the saved run's)",
                              stacklevel=2)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.scheduler is not None:
            self._frozen_shares.append(self.scheduler.num_frozen / self.scheduler.num_layers)
            self.scheduler.step()
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Callbacks after this one (the progress printer) and the log history see the share;
        # reporting integrations that run before user callbacks do not.
        if logs is not None and self._frozen_shares:
            share = round(sum(self._frozen_shares) / len(self._frozen_shares), 4)
            logs["slimfit_frozen_share"] = share
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1]["slimfit_frozen_share"] = share
            self._frozen_shares.clear()
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.scheduler is not None and not self.scheduler.closed:
            self.scheduler.close()
        return control

    def on_save(self, args, state, control, **kwargs):
        if self.scheduler is None or not state.is_world_process_zero:
            return control
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(folder):
            torch.save(self.scheduler.state_dict(), os.path.join(folder, STATE_FILE))
        return control
