"""slimfit.optim on a CUDA device: the offload's pinned copies on a side stream, the compressed state and the
step in backward, each against the plain optimizer on the same device (run with: pytest -m gpu)."""
import gc
import io

import pytest
import torch
from _optim_models import build, data, frozen_params, loss_of, train, weights

from slimfit.optim import attach_frozen_state, encoded_nbytes, step_in_backward
from slimfit.optim.keys import HOST, Q8
from slimfit.scheduler import ILSScheduler
from slimfit.step_memory import measure_step

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")


def _cuda_batch():
    return tuple(t.to(CUDA) for t in data())


def _setup(mode, seed=0, lr=1e-2, **model_kwargs):
    model = build(seed, **model_kwargs).to(CUDA)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, frozen_state=None)
    holder = attach_frozen_state(sched, opt, mode=mode, seed=seed) if mode else None
    return model, opt, sched, holder


def test_offload_trajectory_is_bit_identical_and_the_host_copies_are_pinned():
    batch = _cuda_batch()
    ref_model, ref_opt, ref_sched, _ = _setup(None)
    train(ref_model, ref_opt, batch, 8, sched=ref_sched)
    model, opt, sched, holder = _setup("offload")
    for _ in range(8):
        train(model, opt, batch, 1, sched=sched)
        for p in frozen_params(sched):
            st = opt.state.get(p, {})
            if "exp_avg" + HOST in st:
                host = st["exp_avg" + HOST]
                assert host.device.type == "cpu" and host.is_pinned() and "exp_avg" not in st
    assert holder.held_params()
    sched.close()
    assert all(torch.equal(a, b) for a, b in zip(weights(model), weights(ref_model)))


def _measured(mode):
    """One measured step after 4, as numbers only, with the bytes live before the model was built taken off
    the total (CUDA's peak counts everything allocated in the process). lr 0: the same frozen sets."""
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model, opt, sched, holder = _setup(mode, lr=0.0, d=256, depth=4)
    batch = _cuda_batch()
    train(model, opt, batch, 4, sched=sched)
    frozen = [p.numel() for p in frozen_params(sched) if p in opt.state]
    run = measure_step(model, lambda: loss_of(model, batch), opt)
    codes_on_device = holder is not None and all(
        v["codes"].device.type == "cuda" for p in holder.held_params() for k, v in opt.state[p].items()
        if k.endswith(Q8))
    held = holder.held_nbytes() if holder is not None else 0
    return {"total": run.total - before, "state": run.optimizer_state, "frozen": frozen, "held": held,
            "codes_on_device": codes_on_device}


def test_offload_takes_the_frozen_state_off_the_device():
    """The step's optimizer state on the device drops by the frozen layers' full moments, and its peak too."""
    plain, off = _measured(None), _measured("offload")
    assert plain["frozen"] and plain["frozen"] == off["frozen"]
    full = sum(8 * n for n in plain["frozen"])
    assert plain["state"] - off["state"] == full
    assert plain["total"] - off["total"] >= full * 0.9   # the allocator's block rounding may keep a little


def test_compressed_state_on_the_device_saves_what_the_format_says():
    plain, comp = _measured(None), _measured("compress")
    held = sum(2 * encoded_nbytes(n) for n in plain["frozen"])
    assert comp["held"] == held and comp["codes_on_device"]
    assert plain["state"] - comp["state"] == sum(8 * n for n in plain["frozen"]) - held


def test_offload_checkpoint_round_trip_on_the_device():
    model, opt, sched, _ = _setup("offload")
    batch = _cuda_batch()
    train(model, opt, batch, 3, sched=sched)
    buffer = io.BytesIO()   # opt.state_dict() waits for the side stream: every host copy complete
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    model2, opt2, sched2, _ = _setup("offload")
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert all(v.is_pinned() for st in opt2.state.values() for k, v in st.items() if k.endswith(HOST))
    train(model, opt, batch, 3, sched=sched)
    train(model2, opt2, batch, 3, sched=sched2)
    assert all(torch.equal(a, b) for a, b in zip(weights(model), weights(model2)))


@pytest.mark.parametrize("kwargs", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
def test_step_in_backward_equals_a_plain_loop_on_the_device(kwargs):
    batch = _cuda_batch()
    plain_model, model = build(0).to(CUDA), build(0).to(CUDA)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2, weight_decay=0.1, **kwargs)
    opt = step_in_backward(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, **kwargs)
    train(plain_model, plain, batch, 5)
    train(model, opt, batch, 5)
    assert all(torch.equal(a, b) for a, b in zip(weights(plain_model), weights(model)))


@pytest.mark.parametrize("in_backward", [False, True], ids=["chunked", "in_backward"])
def test_host_state_streamed_in_pieces_is_bit_identical_and_pinned(in_backward):
    """optimizer_state="host" on the device: every moment in pinned host memory between steps, streamed a piece
    at a time (the copies on the compute stream, non-blocking); the weights equal the state in full's, bit for
    bit, and a state_dict read on the host sees the finished copies."""
    batch = _cuda_batch()

    def run(state):
        model = build(0, d=256).to(CUDA)
        opt = (step_in_backward(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1) if in_backward else
               torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
        sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, optimizer_state=state, seed=3,
                             warmup_steps=0, step_chunk_numel=4096)
        train(model, opt, batch, 6, sched=sched)
        return model, opt, sched

    ref, ref_opt, _ = run("full")
    model, opt, sched = run("host")
    for p in model.parameters():
        host = opt.state[p]["exp_avg" + HOST]
        assert host.device.type == "cpu" and host.is_pinned() and "exp_avg" not in opt.state[p]
    saved = opt.state_dict()   # synchronizes: the host copies are complete
    assert saved["state"]
    sched.close()
    assert all(torch.equal(a, b) for a, b in zip(weights(model), weights(ref)))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])
