"""bench/_measure.py: the measured training step every memory benchmark shares (saved bytes, total step peak,
step time), its set-up and undo of a row, and the runner."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bench import _measure, _timing  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tests/conftest.py's one_thread) for every test here."""


def test_build_overrides_depth_and_positions():
    arch, model = _measure.build("bert-tiny", layers=1, seq_len=256)
    assert model.config.num_hidden_layers == 1 and model.config.max_position_embeddings == 256
    assert arch.config["num_hidden_layers"] == 1 and model.training
    inputs = _measure.inputs(model, arch, batch=2, seq_len=200)
    assert inputs["input_ids"].shape == (2, 200)


def test_configured_rows_are_measured_and_undone():
    arch, model = _measure.build("bert-tiny")
    inputs = _measure.inputs(model, arch, batch=2, seq_len=16)
    frozen, _ = _measure.frozen_set(model, 0.5)
    classes = {n: type(m) for n, m in model.named_modules()}
    cases = [_measure.Case("plain", lambda: _measure.configured(model, inputs)),
             _measure.Case("paper+frozen", lambda: _measure.configured(model, inputs, config="paper", frozen=frozen,
                                                                       attn="eager"))]
    seen = []
    what = _measure.What(time=_timing.Settings.quick())
    results = dict((c.name, r) for c, r in _measure.run(cases, what, on_result=lambda c, r: seen.append(c.name)))
    assert seen == ["plain", "paper+frozen"]
    # undone: the original classes, every parameter trainable, sdpa attention, no gradient left
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    plain, paper = results["plain"], results["paper+frozen"]
    for r in (plain, paper):
        p = r.peak
        assert sum(p.parts().values()) == p.total > p.resident > 0 and r.timing.ms > 0
        assert r.timing.wall_ms is not None and r.timing.process_ms is not None
        assert p.peak_phase in ("forward", "backward", "optimizer")
    assert paper.saved.total < plain.saved.total and paper.peak.total < plain.peak.total
    assert paper.peak.weights == plain.peak.weights
    assert paper.mib("peak") == paper.peak.total / 2**20 and paper.mib("saved_at_peak") == paper.peak.saved / 2**20
    columns = _measure.peak_columns(paper)
    assert tuple(columns) == _measure.PEAK_COLUMNS and columns["step_peak_bytes"] == paper.peak.total


def test_a_setup_with_its_own_optimizer_scheduler_and_extra_arguments():
    import torch

    arch, model = _measure.build("bert-tiny")
    inputs = _measure.inputs(model, arch, batch=2, seq_len=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    calls = []
    setup = _measure.Setup(model, inputs, optimizer=optimizer, after_step=lambda: calls.append("after"),
                           extra=lambda: calls.append("extra") or {})
    result = _measure.measure(setup, _measure.What(saved=False, time=None))
    assert result.saved is None and result.timing is None and result.peak.optimizer_state == 0  # SGD: no state
    assert calls == ["extra", "after"]


def test_a_primed_step_finds_the_optimizer_state_resident_and_an_unprimed_one_does_not():
    arch, model = _measure.build("bert-tiny")
    inputs = _measure.inputs(model, arch, batch=2, seq_len=8)
    what = _measure.What(saved=False)
    unprimed = _measure.measure(_measure.Setup(model, inputs, prime=False), what).peak
    primed = _measure.measure(_measure.Setup(model, inputs), what).peak
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert primed.resident - unprimed.resident >= 2 * weights  # AdamW's two moments


def test_frozen_set_of_other_scheduled_kinds():
    from slimfit.scheduler import ILSScheduler

    arch, model = _measure.build("bert-tiny")
    frozen, candidates = _measure.frozen_set(model, 0.5, seed=1, scheduled_kinds="all")
    _, default_candidates = _measure.frozen_set(model, 0.5, seed=1)
    assert set(default_candidates) < set(candidates) and any("LayerNorm" in n for n in candidates)
    assert all(p.requires_grad for p in model.parameters())
    ILSScheduler(model, freeze_rate=0.5, seed=1, scheduled_kinds="all", warmup_steps=0).apply()
    assert sorted(frozen) == sorted(n for n, p in model.named_parameters() if not p.requires_grad)


def test_saved_of_a_call_and_its_bytes_per_group():
    import torch

    arch, model = _measure.build("bert-tiny")
    inputs = _measure.inputs(model, arch, batch=2, seq_len=8)
    row = _measure.measure(_measure.Setup(model, inputs), _measure.What(peak=False)).saved
    call = _measure.saved_of(model, **inputs)
    assert call.total == row.total > 0
    groups = _measure.saved_by_group(call, [("attention", lambda path: ".attention." in path),
                                            ("layers", lambda path: ".layer." in path)])
    assert list(groups) == ["attention", "layers", "other"] and sum(groups.values()) == call.total
    assert groups["attention"] > 0 and groups["layers"] > 0
    assert _measure.saved_of(lambda x: x.exp(), torch.ones(4, requires_grad=True), backward=False).total == 16


def test_time_interleaved_times_a_step_with_its_own_loss_and_what_follows_it():
    arch, model = _measure.build("bert-tiny")
    inputs = _measure.inputs(model, arch, batch=2, seq_len=8)
    calls = []
    setup = _measure.Setup(model, inputs, loss_fn=lambda out: calls.append("loss") or out.logits.pow(2).mean())
    train, after = _measure.time_interleaved(setup, [lambda: calls.append("after")], warmup=1, reps=2)
    assert calls == ["loss", "after"] * 3 and train.reps == after.reps == 2 and train.ms > 0
    with pytest.raises(ValueError, match="timed only"):
        _measure.measure(setup)


def test_fixed_settings_time_exactly_that_many_runs():
    calls = []
    timing = _timing.bench(lambda: calls.append(1), "cpu", _timing.Settings.fixed(4, warmup=1))
    assert timing.reps == 4 and len(calls) == 5
