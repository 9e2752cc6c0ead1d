"""The default checkpoint of a slimfit optimizer (every moment held 8-bit under keys like
``exp_avg@slimfit_q8``) loads into a plain torch Adam/AdamW, which steps from it as torch steps from the
decoded moments, bit for bit; slimfit resumes from it exactly (the held entries ride beside the plain
moments). The small slimfit-only format says what it is. Issue #38, item 6 (a)."""
import io

import pytest
import torch
from _optim_models import build, data, loss_of, train, weights

from slimfit.memory.peak import _Tracker
from slimfit.optim import checkpoint as ckpt
from slimfit.optim import codec, held_state_dict, restore_state, set_checkpoint_format
from slimfit.optim.keys import HOST, Q8
from slimfit.scheduler import ILSScheduler

MOMENTS = ("exp_avg", "exp_avg_sq")


def _through_a_file(obj):
    """What a checkpoint gives back: a copy, read with torch.load's default (weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def _run(frozen_state="auto", opt_class=torch.optim.AdamW, seed=0, steps=3, **opt_kw):
    """A model trained ``steps`` steps under the scheduler's defaults (rate 0.5 on the toy MLP)."""
    model = build(seed)
    opt = opt_class(model.parameters(), lr=1e-2, **opt_kw)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, seed=0, frozen_state=frozen_state, warmup_steps=0)
    train(model, opt, data(), steps, sched=sched)
    return model, opt, sched


def _moments(opt_kw) -> tuple:
    return MOMENTS + (("max_exp_avg_sq",) if opt_kw.get("amsgrad") else ())


@pytest.mark.parametrize("opt_class,opt_kw", [(torch.optim.AdamW, {}), (torch.optim.Adam, {}),
                                              (torch.optim.AdamW, {"amsgrad": True, "weight_decay": 0.1})],
                         ids=["adamw", "adam", "adamw-amsgrad"])
def test_a_plain_optimizer_steps_from_the_default_checkpoint_as_torch_from_the_decoded_moments(opt_class, opt_kw):
    model, opt, sched = _run(opt_class=opt_class, **opt_kw)
    live = {i: dict(st) for i, st in enumerate(opt.state[p] for p in model.parameters())}
    assert all(k + Q8 in st for st in live.values() for k in _moments(opt_kw))   # every moment held 8-bit
    saved = _through_a_file(opt.state_dict())
    for i, st in saved["state"].items():   # the standard keys, plain host tensors: what decode restores
        assert set(st) == {"step", *_moments(opt_kw)}
        for k in _moments(opt_kw):
            assert type(st[k]) is torch.Tensor and st[k].device.type == "cpu"
            assert torch.equal(st[k], codec.decode(live[i][k + Q8]))

    batch = data(seed=7)
    plain_model, ref_model = build(1), build(1)
    plain_model.load_state_dict(model.state_dict())
    ref_model.load_state_dict(model.state_dict())
    plain = opt_class(plain_model.parameters(), lr=1.0)
    plain.load_state_dict(saved)                      # groups (lr, betas, amsgrad) come from the checkpoint
    ref = opt_class(ref_model.parameters(), lr=1e-2, **opt_kw)
    for q, st in zip(ref_model.parameters(), live.values()):   # torch's step from the decoded moments
        ref.state[q] = {"step": st["step"].clone(), **{k: codec.decode(st[k + Q8]) for k in _moments(opt_kw)}}
    for m, o in ((plain_model, plain), (ref_model, ref)):
        loss_of(m, batch).backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), ref_model.parameters()))
    assert all(torch.equal(plain.state[a][k], ref.state[b][k]) for a, b in zip(plain_model.parameters(),
               ref_model.parameters()) for k in _moments(opt_kw))


def _resumed(frozen_state, fmt, opt_kw, total=8, stop=4, mid_step=False):
    """Weights after ``total`` steps, checkpointed after ``stop`` into new objects (other initial weights)
    through a file; ``mid_step``: written between the optimizer's step and the scheduler's."""
    model, opt, sched = _run(frozen_state, steps=stop, **opt_kw)
    if mid_step:
        loss_of(model, data()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    set_checkpoint_format(opt, fmt)
    saved = _through_a_file({"model": model.state_dict(), "opt": opt.state_dict(),
                             "sched": sched.state_dict(include_snapshots=mid_step)})
    model, opt, sched = _run(frozen_state, seed=123, steps=0, **opt_kw)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    if mid_step:
        opt.step()   # as a resumed loop's optimizer step is counted (no gradients: no update)
        sched.step()
    train(model, opt, data(), total - stop - mid_step, sched=sched)
    return model, opt


@pytest.mark.parametrize("fmt", ["portable", "held"])
@pytest.mark.parametrize("frozen_state,opt_kw", [("auto", {}), ("auto", {"amsgrad": True}), ("compress", {}),
                                                 ("offload", {})], ids=["auto", "auto-amsgrad", "compress", "offload"])
def test_slimfit_resumes_from_its_checkpoint_as_the_uninterrupted_run(frozen_state, opt_kw, fmt):
    ref, ref_opt, _ = _run(frozen_state, steps=8, **opt_kw)
    model, opt = _resumed(frozen_state, fmt, opt_kw)
    assert all(torch.equal(a, b) for a, b in zip(weights(model), weights(ref)))
    suffix = HOST if frozen_state == "offload" else Q8   # held again, as in the uninterrupted run
    for p, q in zip(model.parameters(), ref.parameters()):
        assert sorted(opt.state[p]) == sorted(ref_opt.state[q])
        assert all(codec.is_encoded(v) or type(v) is torch.Tensor for k, v in opt.state[p].items()
                   if k.endswith(suffix))


def test_a_mid_step_checkpoint_resumes_as_the_uninterrupted_run():
    ref, _, _ = _run(steps=8)
    model, _ = _resumed("auto", "portable", {}, stop=4, mid_step=True)
    assert all(torch.equal(a, b) for a, b in zip(weights(model), weights(ref)))


def test_the_held_format_says_it_is_slimfit_only_and_restore_state_decodes_it():
    model, opt, _ = _run()
    saved = _through_a_file(held_state_dict(opt))
    assert "slimfit_held" not in saved and "restore_state" in saved[ckpt.SLIMFIT_ONLY]
    assert all(k + Q8 in st and k not in st for st in saved["state"].values() for k in MOMENTS)
    assert "slimfit_only" not in opt.state_dict()    # held_state_dict is once: the default is back
    twin = build(0)
    twin.load_state_dict(model.state_dict())
    plain = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    plain.load_state_dict(saved)
    loss_of(twin, data()).backward()
    with pytest.raises(KeyError, match="exp_avg"):   # what the marker warns of
        plain.step()
    assert restore_state(plain) == len(saved["state"])
    plain.step()
    with pytest.raises(ValueError, match="'portable'"):
        set_checkpoint_format(opt, "small")


def test_offload_writes_each_host_copy_once():
    """Offloaded moments are plain already: the portable checkpoint shares their storages with the held
    entries, so the file holds each once (no bigger than the held format's)."""
    model, opt, sched = _run("offload")
    sd = opt.state_dict()
    held = sd["slimfit_held"]
    assert held and all(sd["state"][i][k[: -len(HOST)]] is v for i, h in held.items() for k, v in h.items())
    sizes = {}
    for fmt in ("portable", "held"):
        set_checkpoint_format(opt, fmt)
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        sizes[fmt] = buffer.tell()
    assert sizes["portable"] <= sizes["held"] + 4096


def test_torch_s_own_checkpoint_and_a_plain_optimizer_s_resave_load_into_slimfit():
    """No sidecar (a plain optimizer wrote it): the plain moments are the state, held again by the scheduler."""
    model, opt, sched = _run()
    twin = build(0)
    twin.load_state_dict(model.state_dict())
    plain = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    plain.load_state_dict(_through_a_file(opt.state_dict()))
    train(twin, plain, data(), 1, schedule=None)
    resaved = _through_a_file(plain.state_dict())
    assert "slimfit_held" not in resaved
    model2, opt2, sched2 = _run(seed=5, steps=0)
    model2.load_state_dict(twin.state_dict())
    opt2.load_state_dict(resaved)
    for p, q in zip(model2.parameters(), twin.parameters()):
        assert all(torch.equal(opt2.state[p][k], plain.state[q][k]) for k in MOMENTS)
    sched2.load_state_dict(sched.state_dict())      # the scheduler's frozen set holds its layers' again
    assert all(k + Q8 in opt2.state[p] for p in sched2.params for k in MOMENTS)
    train(model2, opt2, data(), 1, sched=sched2)     # and the chunked step every other parameter's
    assert all(k + Q8 in st and k not in st for st in opt2.state.values() for k in MOMENTS)


def test_decoding_a_piece_at_a_time_is_decode_and_bounds_the_rise(monkeypatch):
    """Pieces of 896 elements (7 groups): each moment is what decode restores; state_dict() adds the decoded
    moments (the checkpoint's own bytes) and a few pieces' temporaries, never a moment's."""
    monkeypatch.setattr(ckpt, "_PIECE", 1000)
    model, opt, _ = _run()
    live = [dict(opt.state[p]) for p in model.parameters()]
    with _Tracker(torch.device("cpu")) as tracker:
        sd = opt.state_dict()
    series = tracker.series()
    rise = max(series) - series[0]
    plain_bytes = sum(sd["state"][i][k].nbytes for i in sd["state"] for k in MOMENTS)
    assert plain_bytes <= rise <= plain_bytes + 8 * 896 * 4
    for i, st in enumerate(live):
        assert all(torch.equal(sd["state"][i][k], codec.decode(st[k + Q8])) for k in MOMENTS)
