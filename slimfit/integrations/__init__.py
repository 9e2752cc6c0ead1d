"""slimfit at the edge: the training frameworks' hooks, above both the scheduler and the patch.

    trainer.py   SlimFitCallback: transformers.Trainer (and TRL's SFTTrainer, a Trainer) steps an ILSScheduler
                 and, given config=, patches the model when the Trainer is built

Each module imports its framework; nothing below slimfit.integrations imports it, so the scheduler and the
patch work without those frameworks installed. ``slimfit.scheduler.SlimFitCallback`` is this callback, loaded
on first use.
"""
__all__ = ["SlimFitCallback", "STATE_FILE"]


def __getattr__(name):
    # transformers is optional: load the Trainer module only when one of its names is asked for.
    if name in __all__:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
