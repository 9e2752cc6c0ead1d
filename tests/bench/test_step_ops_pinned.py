"""The ops slimfit's training step dispatches cannot creep up: bench/step_ops.py's counts of the quick shapes
(bert-tiny batch 2 seq 16, llama-tiny batch 1 seq 32), per phase, held at or below the counts measured when
they were pinned. On a GPU every such op is about one kernel launch, and the host launching them is
what bounds a step of short kernels, so more ops is a slower step there.

A change that lowers a count should lower its ceiling here to the new count, so that the launches it removed
cannot come back unnoticed. A change that must raise one says why in its commit."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bench import step_ops  # noqa: E402

# (device, model, row): {phase: ceiling}. The counts of the commit that pinned them (torch 2.13, transformers
# 5.24), step 3 of bench/step_ops.py's quick shapes; the CPU rows count every phase, the fake-cuda rows the
# optimizer and scheduler on a stand-in device (their forward and backward do not run there).
CEILINGS = {
    ("cpu", "bert-tiny", "slimfit"): dict(forward=93, backward=148, optimizer=9, scheduler=29),
    ("cpu", "bert-tiny", "slimfit-full-state"): dict(forward=93, backward=148, optimizer=88, scheduler=29),
    ("cpu", "llama-tiny", "slimfit"): dict(forward=180, backward=142, optimizer=9, scheduler=29),
    ("cpu", "llama-tiny", "slimfit-full-state"): dict(forward=180, backward=142, optimizer=44, scheduler=29),
    ("fake-cuda", "bert-tiny", "slimfit"): dict(optimizer=4, scheduler=1),
    ("fake-cuda", "bert-tiny", "slimfit-full-state"): dict(optimizer=30, scheduler=1),
    ("fake-cuda", "llama-tiny", "slimfit"): dict(optimizer=4, scheduler=1),
    ("fake-cuda", "llama-tiny", "slimfit-full-state"): dict(optimizer=30, scheduler=1),
}


@pytest.fixture(scope="module")
def counted():
    rows = step_ops.run(step_ops.QUICK_MODELS, rows=step_ops.SLIMFIT_ROWS)
    return {(r.device, r.model, r.row): r for r in rows}


@pytest.mark.parametrize("key", list(CEILINGS), ids=lambda k: "-".join(k))
def test_slimfit_step_ops_stay_at_or_below_their_ceilings(counted, key):
    r = counted[key]
    over = {phase: (r.n(phase), ceiling) for phase, ceiling in CEILINGS[key].items() if r.n(phase) > ceiling}
    assert not over, (f"{key}: ops per phase above the pinned ceiling (count, ceiling): {over}; the ops of the "
                      f"phase now: {dict(r.ops[next(iter(over))].most_common(8))}")
    for phase in CEILINGS[key]:
        assert r.n(phase) is not None and r.n(phase) > 0, (key, phase)
