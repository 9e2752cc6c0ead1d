"""`slimfit plan --fit`: the configuration it picks fits when measured for real, on a tiny model and tiny budgets;
it says so when nothing fits; the code it prints is the configuration's."""
from __future__ import annotations

import pytest

from slimfit.memory.plan.search import candidates, fit
from slimfit.plan import StepSpec, measure, predict

BASE = StepSpec("bert-tiny", batch=4, seq=64)


def test_candidates_cover_presets_rates_lora_checkpointing_and_frozen_state():
    specs = candidates(BASE)
    assert len(specs) == 88 and len(set(specs)) == 88
    assert {s.preset for s in specs} == {"none", "exact", "paper", "aggressive"}
    assert {s.rate for s in specs} == {0.0, 0.5, 0.7, 0.9} and {s.lora for s in specs} == {None, 8}
    assert all(not (s.lora and s.rate) for s in specs)
    held = [s for s in specs if s.frozen_state]
    assert {s.frozen_state for s in held} == {"compress", "compress_all"} and all(s.rate for s in held)  # offload:
    # GPU only
    assert {s.replace(frozen_state=None) for s in held} <= set(specs)
    on_gpu = candidates(BASE.replace(device="cuda"))
    assert len(on_gpu) == 136 and {s.frozen_state for s in on_gpu} == {None, "compress", "offload", "compress_all",
                                                                         "offload_all"}
    # every state on the host only with the step in backward, which nothing else searched takes
    assert all(s.step_in_backward == (s.frozen_state == "offload_all") for s in on_gpu)
    assert not any(s.frozen_state for s in candidates(BASE.replace(optimizer="adamw8bit")))


@pytest.fixture(scope="module")
def plain_peak():
    """The predicted peak of the plain step, the scale the budgets are taken from."""
    return predict(BASE).total


# one budget in the default suite (each fit predicts its 80 estimates: about a minute on 2 cores); the others slow
@pytest.mark.parametrize("share", [pytest.param(0.98, marks=pytest.mark.slow), 0.8,
                                   pytest.param(0.55, marks=pytest.mark.slow)])
def test_the_configuration_picked_fits_when_measured(share, plain_peak):
    budget = int(share * plain_peak)
    result = fit(BASE, budget)
    assert result.best is not None
    measured = measure(result.best.spec)
    assert measured.total <= budget, (result.best.spec.label(), measured.total, budget)
    tried = [c for c in result.candidates if c.prediction is not None]
    assert tried[-1] is result.best and all(c.total > budget for c in tried[:-1])
    assert [c.est_seconds for c in result.candidates] == sorted(c.est_seconds for c in result.candidates)
    # of the same configuration, the state in full is tried before the 8-bit one
    order = {c.spec: i for i, c in enumerate(result.candidates)}
    assert all(order[s.replace(frozen_state=None)] < i for s, i in order.items() if s.frozen_state)


@pytest.mark.slow
def test_nothing_fits_a_budget_below_the_weights(capsys):
    from slimfit import cli

    assert cli.main(["plan", "bert-tiny", "--batch", "4", "--seq", "64", "--fit", "100KiB"]) == 1
    out = capsys.readouterr().out
    assert "nothing fits" in out and "resident alone too big" in out


def test_fit_prints_the_code_of_the_configuration_and_its_progress(capsys, plain_peak):
    from slimfit import cli

    assert cli.main(["plan", "bert-tiny", "--batch", "4", "--seq", "64", "--fit", str(int(0.8 * plain_peak))]) == 0
    captured = capsys.readouterr()
    out, err = captured.out, captured.err.splitlines()
    # progress on stderr: one line per configuration estimated, then the predictions
    assert len([line for line in err if " estimated " in line]) == len(candidates(BASE))
    assert any(" predicted " in line and "step peak" in line for line in err)
    assert "fastest that fits:" in out and "optimizer.step()" in out and "loss.backward()" in out
    chosen = out.split("fastest that fits:")[1].splitlines()[0]
    if "rate" in chosen:
        assert "ILSScheduler(model, freeze_rate=" in out and "scheduler.step()" in out
    if "LoRA" in chosen:
        assert "get_peft_model(model, LoraConfig(r=8" in out
    if any(p in chosen for p in ("exact", "paper", "aggressive")):
        assert "slimfit.patch(model, slimfit.SlimFitConfig." in out
    code = out.split("of the budget)")[1]
    compile(code.replace("model = ...", "model = None"), "<plan>", "exec")  # it parses as Python


def test_estimates_of_a_tied_embedding_decoder_stay_positive():
    """SmolLM2 ties its LM head to the embedding, which the scheduler schedules: frozen at the rate, it was
    subtracted from every frozen layer's increment, so the estimated times and resident bytes of its rate
    configurations came out negative and --fit ranked them first."""
    from slimfit.memory.models import resolve_model
    from slimfit.memory.plan.search import estimate

    base = StepSpec("smollm2-135m", batch=1, seq=64, preset="paper", rate=0.9, frozen_state=None)
    specs = [base, base.replace(frozen_state="compress"), base.replace(rate=0.0)]
    got = {c.spec: c for c in estimate(specs, resolve_model("smollm2-135m"))}
    assert all(c.est_seconds > 0 and c.resident > 0 for c in got.values())
    assert got[specs[1]].resident < got[specs[0]].resident <= got[specs[2]].resident
