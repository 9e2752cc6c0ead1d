"""copy.deepcopy of a fake model while a planned step is built (peft deep-copies the head it trains beside LoRA):
fake parameters again, of the same fake mode, the mode itself never copied; and the LoRA predictions that
crashed the process when torch's own Tensor.__deepcopy__ copied the mode."""
import copy

import torch

from slimfit.memory.plan.fake import deepcopy_by_clone, new_fake_mode
from slimfit.plan import StepSpec, predict


def test_a_fake_module_deep_copies_to_fake_parameters_of_the_same_mode():
    mode = new_fake_mode()
    with mode:
        layer = torch.nn.Linear(4, 3)
    layer.bias.requires_grad_(False)
    with mode, deepcopy_by_clone():
        twin = copy.deepcopy(layer)
    for name in ("weight", "bias"):
        old, new = getattr(layer, name), getattr(twin, name)
        assert isinstance(new, torch.nn.Parameter) and new is not old
        assert new.fake_mode is mode and new.shape == old.shape and new.requires_grad == old.requires_grad
    assert [n for n, _ in twin.named_parameters()] == ["weight", "bias"]


def test_torchs_deepcopy_is_back_after_the_build():
    from torch._subclasses.fake_tensor import FakeTensor

    before = FakeTensor.__dict__.get("__deepcopy__")
    with deepcopy_by_clone():
        assert FakeTensor.__dict__.get("__deepcopy__") is not before
    assert FakeTensor.__dict__.get("__deepcopy__") is before


def test_lora_predictions_one_after_another():
    """The second LoRA prediction of a standalone process segfaulted (bert-tiny, 1 then 2 layers: 5 runs in 5;
    under pytest the heap was laid out so that it passed, which the test above does not depend on)."""
    spec = StepSpec("bert-tiny", batch=2, seq=16, lora=8)
    first, second = predict(spec.replace(layers=1)), predict(spec.replace(layers=2))
    assert 0 < first.total < second.total
