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
