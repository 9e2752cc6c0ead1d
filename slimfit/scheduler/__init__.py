"""Which parameters are frozen this step: SlimFit's inter-layer scheduling (ILS).

Pure Python + torch: flips ``param.requires_grad`` and nothing else; it does not import
slimfit.kernels or slimfit.autograd. See docs/scheduler.md.

    from slimfit.scheduler import ILSScheduler, SchedulerConfig
    sched = ILSScheduler(model, freeze_rate=0.7, optimizer=opt)       # or ILSScheduler(model, SchedulerConfig(...))
    ... opt.step(); opt.zero_grad(); sched.step()

Modules: config (SchedulerConfig: every option, validated once; ExperimentalOptions), candidates
(which parameters are layers), scores (how much they moved), selection (which to train next), budget
(activation-memory estimates and budgets), optim (frozen parameters never move), ddp (same decision on
every rank), ils (the scheduler: state and lifecycle), state (checks of a saved state before it is
loaded). The transformers.Trainer callback lives in slimfit.integrations.trainer (above the patch layer);
``slimfit.scheduler.SlimFitCallback`` loads it on first use, so importing the scheduler imports neither
transformers nor slimfit.patching.
"""
from .budget import estimate_activation_bytes, min_rate_for_budget
from .candidates import find_candidates
from .config import ExperimentalOptions, SchedulerConfig
from .ils import ILSScheduler
from .optim import FrozenGradGuard
from .scores import compute_scores
from .selection import num_frozen

__all__ = ["ILSScheduler", "SchedulerConfig", "ExperimentalOptions", "SlimFitCallback", "HFCallback",
           "find_candidates", "compute_scores", "estimate_activation_bytes", "min_rate_for_budget", "num_frozen",
           "FrozenGradGuard"]


def __getattr__(name):
    # transformers is optional, and the callback sits above the patch layer: load it only when asked for.
    if name in ("SlimFitCallback", "HFCallback"):
        from slimfit.integrations.trainer import SlimFitCallback
        return SlimFitCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
