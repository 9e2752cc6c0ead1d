"""slimfit: fine-tune transformers in far less accelerator memory."""
from . import kernels, optim  # optim: the optimizer state the scheduler attaches (docs/optim.md)
from .config import AttentionSaving, LinearSampling, SlimFitConfig

# slimfit.patch / slimfit.unpatch are the functions; their package is slimfit.patching.
from .patching import patch, unpatch
from .patching.compile import compile_regions as compile  # noqa: A001  (slimfit.compile(model): regional torch.compile)

__version__ = "0.1.0"


def __getattr__(name):
    # Heavier layers load on first use, so `import slimfit` stays light.
    if name in ("autograd", "memory", "scheduler", "reversible"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    if name in ("ILSScheduler", "SchedulerConfig"):
        from . import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module 'slimfit' has no attribute {name!r}")


__all__ = ["kernels", "optim", "SlimFitConfig", "AttentionSaving", "LinearSampling", "patch", "unpatch", "compile",
           "ILSScheduler", "SchedulerConfig", "autograd", "memory", "scheduler", "reversible", "__version__"]
