"""The 8-bit AdamW stand-in of a prediction holds exactly the bytes torchao's AdamW8bit keeps."""
from __future__ import annotations

import pytest
import torch

from slimfit.memory.plan.optim8bit import FakeAdamW8bit, available


def _bytes(obj) -> int:
    """Bytes of a tensor, a list of tensors or a tensor subclass's inner tensors."""
    if isinstance(obj, (list, tuple)):
        return sum(_bytes(t) for t in obj)
    if hasattr(obj, "__tensor_flatten__"):
        names, _ = obj.__tensor_flatten__()
        return sum(_bytes(getattr(obj, n)) for n in names)
    return obj.numel() * obj.element_size()


@pytest.mark.skipif(not available(), reason="torchao is not installed")
def test_state_bytes_match_torchao():
    from torchao.optim import AdamW8bit

    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((64, 256), (4096,), (100, 41), (3, 4))]
    real = AdamW8bit(params, lr=0.0)
    stand_in = FakeAdamW8bit(params)
    for p in params:
        torchao_state = {"exp_avg": real._new_buffer(p, True), "exp_avg_sq": real._new_buffer(p, False)}
        ours = stand_in.state[p]
        assert _bytes(ours["exp_avg"]) == _bytes(torchao_state["exp_avg"])
        assert _bytes(ours["exp_avg_sq"]) == _bytes(torchao_state["exp_avg_sq"])


@pytest.mark.skipif(not available(), reason="torchao is not installed")
def test_prediction_with_8bit_state_is_smaller_than_with_fp32_state():
    from slimfit.plan import StepSpec, predict

    fp32 = predict(StepSpec("bert-tiny", batch=2, seq=32)).memory.optimizer_state
    int8 = predict(StepSpec("bert-tiny", batch=2, seq=32, optimizer="adamw8bit")).memory.optimizer_state
    assert int8 < 0.35 * fp32
