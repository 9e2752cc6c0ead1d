"""DeepSpeed ZeRO is refused by name, never trained silently wrong: a ZeRO-3 parameter (its values outside the
tensor), a DeepSpeed engine and a DeepSpeed optimizer (stand-ins: DeepSpeed is not installed here; the checks
read a parameter's ds_id and an object's module, as DeepSpeed's own objects carry them)."""
import types

import pytest
import torch
from torch import nn

from slimfit.scheduler import ILSScheduler


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))


def test_a_zero3_partitioned_parameter_is_refused():
    m = _model()
    m[0].weight.ds_id = 0                     # what ZeRO-3 sets on every parameter it partitions
    with pytest.raises(NotImplementedError, match="DeepSpeed ZeRO.*FSDP2"):
        ILSScheduler(m, freeze_rate=0.5)


def _deepspeed_class(base, name):
    """A class that says it is DeepSpeed's, as deepspeed.runtime.engine.DeepSpeedEngine does."""
    return types.new_class(name, (base,), exec_body=lambda ns: ns.update(__module__="deepspeed.runtime.engine"))


def test_a_deepspeed_engine_is_refused():
    inner = _model()
    engine = _deepspeed_class(nn.Module, "DeepSpeedEngine")()
    engine.module = inner
    with pytest.raises(NotImplementedError, match="DeepSpeed ZeRO"):
        ILSScheduler(engine, freeze_rate=0.5)


def test_a_deepspeed_optimizer_is_refused_at_attach():
    m = _model()
    sched = ILSScheduler(m, freeze_rate=0.5)
    opt = _deepspeed_class(torch.optim.AdamW, "DeepSpeedZeroOptimizer")(m.parameters(), lr=1e-3)
    with pytest.raises(NotImplementedError, match="DeepSpeed ZeRO"):
        sched.attach_optimizer(opt)
