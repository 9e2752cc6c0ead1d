"""slimfit.optim owns the optimizer state: the scheduler reaches it by name when an optimizer is attached (no
registry filled by an import), slimfit.optim reads no private name of the scheduler, and "auto" is resolved by
one function (slimfit/_optimizer_state.py) whose answer every caller shares: the scheduler's config, the
optimizer side that attaches the holder, the planner's StepSpec and `slimfit plan`'s flags."""
import argparse
import ast
import pathlib
import warnings

import pytest
import torch
from _optim_models import build, data, train

from slimfit._optimizer_state import (
    FROZEN_STATE_NAMES,
    HOLDERS,
    OPTIMIZER_STATES,
    STEP_KINDS,
    resolve_state_mode,
    to_frozen_state,
)
from slimfit.memory.plan.spec import StepSpec
from slimfit.scheduler import ILSScheduler, SchedulerConfig

SLIMFIT = pathlib.Path(__file__).resolve().parents[2] / "slimfit"
# every spelling: optimizer_state's names and frozen_state's
VALUES = [("optimizer_state", v) for v in OPTIMIZER_STATES] + [("frozen_state", v) for v in FROZEN_STATE_NAMES]


def _private_reads(tree: ast.AST) -> list[str]:
    """Private names of slimfit.scheduler a module imports, and private attributes it reads of an object named
    like a scheduler (scheduler, sched), directly or through getattr."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("slimfit.scheduler"):
            out += [f"import {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_") \
                and node.value.id in ("scheduler", "sched") and not node.attr.startswith("__"):
            out.append(f"{node.value.id}.{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[0], ast.Name)
              and node.args[0].id in ("scheduler", "sched") and isinstance(node.args[1], ast.Constant)
              and str(node.args[1].value).startswith("_")):
            out.append(f"{node.func.id}({node.args[0].id}, {node.args[1].value!r})")
    return out


def test_optim_reads_no_private_name_of_the_scheduler():
    files = sorted((SLIMFIT / "optim").glob("*.py"))
    assert files
    found = {f.name: reads for f in files if (reads := _private_reads(ast.parse(f.read_text())))}
    assert found == {}


def test_the_check_catches_private_reads():
    tree = ast.parse("from slimfit.scheduler.ils import _live\nx = scheduler._index\ny = getattr(sched, '_sums')\n")
    assert _private_reads(tree) == ["import slimfit.scheduler.ils._live", "scheduler._index", "getattr(sched, '_sums')"]


def test_the_scheduler_imports_the_optimizer_side_only_inside_a_function():
    """No registry: slimfit.scheduler names slimfit.optim where an optimizer is attached, never at the top of
    a module, so importing the scheduler's modules loads no kernel code."""
    assert not (SLIMFIT / "scheduler" / "extensions.py").exists()
    inside = []
    for file in sorted((SLIMFIT / "scheduler").glob("*.py")):
        tree = ast.parse(file.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(("slimfit.optim",
                                                                                          "slimfit.kernels")):
                assert id(node) not in top, (file.name, node.module)
                inside.append((file.name, node.module))
    assert inside == [("ils.py", "slimfit.optim.attach")]
    pure = ast.parse((SLIMFIT / "_optimizer_state.py").read_text())
    imported = {a.name for n in ast.walk(pure) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(pure) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "typing", "torch"}


@pytest.mark.parametrize("step", STEP_KINDS)
@pytest.mark.parametrize("momentum", [False, True])
def test_the_config_resolves_as_the_one_rule(step, momentum):
    for name, value in VALUES:
        if momentum and resolve_state_mode(value, "every") is not None and value not in ("auto",):
            continue   # a named mode with momentum is refused (below)
        options = {name: value, **({"frozen_update": "momentum"} if momentum else {})}
        config = SchedulerConfig.from_options(**options)
        assert config.state_mode(step) == resolve_state_mode(value, step, momentum), options
        assert config.frozen_state_mode == to_frozen_state(resolve_state_mode(value, "every", momentum))


def test_the_rule():
    assert [resolve_state_mode("auto", s) for s in STEP_KINDS] == ["8bit", "8bit-frozen", None]
    assert resolve_state_mode("auto", "every", momentum=True) is None
    for value in ("8bit", "8bit-frozen", "host-frozen", "host"):
        assert all(resolve_state_mode(value, s) == value for s in STEP_KINDS)   # named: as it is
    assert resolve_state_mode("full") is None and resolve_state_mode(None) is None
    assert resolve_state_mode("compress_all") == "8bit" and resolve_state_mode("offload") == "host-frozen"
    with pytest.raises(ValueError, match="frozen_state must be one of"):
        resolve_state_mode("compres")


@pytest.mark.parametrize("optimizer,step", [("adamw", "every"), ("adamw8bit", "none")])
def test_the_planner_resolves_as_the_one_rule(optimizer, step):
    for name, value in VALUES:
        expected = resolve_state_mode(value, step)
        if optimizer == "adamw8bit" and expected is not None:
            continue   # a named mode is refused with torchao's optimizer (test_frozen_state_plan.py)
        in_backward = expected == "host"   # every state on the host needs the step in backward
        spec = StepSpec("bert-tiny", batch=2, seq=16, rate=0.5, optimizer=optimizer, step_in_backward=in_backward,
                        **{name: value})
        assert spec.held_state == to_frozen_state(expected), (name, value)
        assert spec.frozen_state == to_frozen_state(spec.optimizer_state)
        assert spec == StepSpec("bert-tiny", batch=2, seq=16, rate=0.5, optimizer=optimizer,
                                step_in_backward=in_backward,
                                optimizer_state=FROZEN_STATE_NAMES[value] if name == "frozen_state" else value)


def test_the_cli_reads_both_flags_as_the_one_option():
    from slimfit.memory.cli import _optimizer_state, add_plan_arguments

    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    base = ["bert-tiny", "--batch", "2"]
    assert _optimizer_state(parser.parse_args(base)) == "auto"
    for value in OPTIMIZER_STATES:
        assert _optimizer_state(parser.parse_args(base + ["--optimizer-state", value])) == value
    for old, new in FROZEN_STATE_NAMES.items():
        flag = "none" if old is None else old
        assert _optimizer_state(parser.parse_args(base + ["--frozen-state", flag])) == new
    assert "--frozen-state" not in parser.format_help() and "--optimizer-state" in parser.format_help()
    with pytest.raises(SystemExit):
        _optimizer_state(parser.parse_args(base + ["--optimizer-state", "full", "--frozen-state", "compress"]))


def _attached(optimizer_class, **options):
    model = build(0)
    opt = optimizer_class(model.parameters(), lr=1e-2)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, **options)
    train(model, opt, data(), 1, sched=sched)
    return sched, opt


@pytest.mark.parametrize("optimizer_class,step", [(torch.optim.AdamW, "every"), (torch.optim.NAdam, "frozen")])
def test_the_scheduler_attaches_what_the_one_rule_says(optimizer_class, step):
    for name, value in VALUES:
        mode = resolve_state_mode(value, step)
        if mode == "8bit" and step == "frozen":
            with pytest.raises(ValueError, match="attach_chunked_step"):   # named, and this step cannot hold it
                _attached(optimizer_class, **{name: value})
            continue
        if mode == "host" and step == "frozen":   # every state on the host: streamed by a step that holds every
            with pytest.raises(ValueError, match="step_in_backward"):   # state (tests/optim/test_host_state.py)
                _attached(optimizer_class, **{name: value})
            continue
        sched, _ = _attached(optimizer_class, **{name: value})
        held = sched.state_holder
        assert (held is None) == (mode is None), (name, value)
        if held is not None:
            assert (held.mode, held.between_steps) == HOLDERS[mode], (name, value)
        assert (sched.chunked_step is not None) == (step == "every")
        sched.close()


def test_the_old_name_reads_and_writes_as_the_new_one():
    config = SchedulerConfig(frozen_state="offload")
    assert config.optimizer_state == "host-frozen" and config.frozen_state == "offload"
    saved = config.to_dict()
    assert saved["optimizer_state"] == "host-frozen" and "frozen_state" not in saved
    old = {k: v for k, v in saved.items() if k != "optimizer_state"}
    assert SchedulerConfig.from_dict({**old, "frozen_state": "compress_all"}).optimizer_state == "8bit"
    assert SchedulerConfig.from_dict(old).optimizer_state == "full"   # saved before either name existed
    assert SchedulerConfig.from_dict(saved) == config
    assert config.replace(optimizer_state="auto").optimizer_state == "auto"
    assert config.replace(frozen_state=None).optimizer_state == "full"
    assert config.replace(seed=3).optimizer_state == "host-frozen"
    with pytest.raises(ValueError, match="disagree"):
        SchedulerConfig(optimizer_state="8bit", frozen_state="compress")
    with pytest.raises(ValueError, match="disagree"):
        SchedulerConfig.from_dict({**saved, "frozen_state": "compress"})
    with pytest.raises(ValueError, match="did you mean 'host-frozen'"):
        SchedulerConfig(optimizer_state="host_frozen")
    assert "optimizer_state='host-frozen'" in repr(config) and "frozen_state" not in repr(config).replace(
        "optimizer_state", "")


def test_a_state_saved_with_the_old_name_reports_a_change():
    sched, _ = _attached(torch.optim.AdamW, optimizer_state="8bit-frozen")
    state = sched.state_dict()
    state["config"] = {**{k: v for k, v in state["config"].items() if k != "optimizer_state"},
                       "frozen_state": "offload"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.load_state_dict(state)
    assert any("optimizer_state" in str(w.message) for w in caught)
    state["config"]["frozen_state"] = "compress"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.load_state_dict(state)
    assert not any("options differ" in str(w.message) for w in caught)
    sched.close()
