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


def _state_bytes(optimizer) -> int:
    """Bytes of every tensor of an optimizer's state, each storage once (bitsandbytes shares its maps)."""
    seen, total = set(), 0
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                total += v.untyped_storage().nbytes()
    return total


def test_bnb_stand_in_holds_the_tensors_bitsandbytes_keeps():
    bnb = pytest.importorskip("bitsandbytes")
    from slimfit.memory.plan.optim8bit import FakeBnbAdamW8bit

    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((64, 256), (4096,), (100, 41), (3, 4), (1000, 7))]
    real = bnb.optim.AdamW8bit(params, lr=0.0)
    for p in params:
        p.grad = torch.zeros_like(p)
    real.step()   # bitsandbytes makes its state at the first step
    stand_in = FakeBnbAdamW8bit(params)

    def layout(state):
        return sorted((k, tuple(v.shape), v.dtype) for k, v in state.items() if torch.is_tensor(v))

    for p in params:
        assert layout(stand_in.state[p]) == layout(real.state[p])
    assert _state_bytes(stand_in) == _state_bytes(real)


def test_bnb_is_planned_for_cuda_and_refused_on_the_cpu():
    from slimfit.plan import StepSpec, predict

    with pytest.raises(ValueError, match="device cuda only"):
        predict(StepSpec("llama-tiny", batch=1, seq=32, optimizer="adamw8bit-bnb"))
    recipe = dict(checkpointing=True, step_in_backward=True, chunked_loss=True, device="cuda")
    bnb = predict(StepSpec("llama-tiny", batch=1, seq=32, optimizer="adamw8bit-bnb", **recipe)).memory
    fp32 = predict(StepSpec("llama-tiny", batch=1, seq=32, **recipe)).memory
    assert bnb.optimizer_state < 0.35 * fp32.optimizer_state
    assert bnb.total < fp32.total
