"""The memory package (slimfit/memory/): its two commands speak one flag vocabulary, its modules import one way
only, one loss policy holds for both measurements, and the public import paths reach the same objects."""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "slimfit" / "memory"


def _parser(command) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"slimfit {command.name}")
    command.add_arguments(parser)
    return parser


def _flags(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """{dest: every option string that sets it, hidden spellings included} of a parser's optional flags."""
    out: dict[str, set[str]] = {}
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            out.setdefault(action.dest, set()).update(action.option_strings)
    return out


def test_memory_and_plan_spell_the_same_concepts_the_same():
    from slimfit.memory.cli import MEMORY, PLAN, SHARED_FLAGS

    memory, plan = _flags(_parser(MEMORY)), _flags(_parser(PLAN))
    shared = {flag[2:].replace("-", "_") for flag in SHARED_FLAGS}
    assert shared <= set(memory) and shared <= set(plan)
    for dest in set(memory) & set(plan):
        assert memory[dest] == plan[dest], dest
    # no concept under two names: a flag string sets one destination in either command
    spellings = {}
    for flags in (memory, plan):
        for dest, strings in flags.items():
            for s in strings:
                assert spellings.setdefault(s, dest) == dest, s
    assert {"--seq-len", "--seq"} <= plan["seq_len"] and {"--freeze-rate", "--rate"} <= plan["freeze_rate"]
    assert {"--attn-implementation", "--attn"} <= plan["attn_implementation"]


def test_one_preset_list_and_hidden_spellings_stay_out_of_the_help():
    from slimfit.memory.cli import MEMORY, PLAN, PRESETS

    for command in (MEMORY, PLAN):
        parser = _parser(command)
        preset = next(a for a in parser._actions if a.dest == "preset")
        assert tuple(preset.choices) == PRESETS
        text = parser.format_help()
        assert "--seq-len" in text and "--seq " not in text and "--rate " not in text and "--attn " not in text


def test_one_default_freeze_rate_the_schedulers():
    from slimfit.memory.cli import DEFAULT_FREEZE_RATE, MEMORY, PLAN, freeze_rate_of
    from slimfit.scheduler import SchedulerConfig

    assert DEFAULT_FREEZE_RATE == SchedulerConfig.__dataclass_fields__["freeze_rate"].default
    memory = _parser(MEMORY).parse_args(["bert-tiny"])
    plan = _parser(PLAN).parse_args(["bert-tiny", "--batch", "2"])
    assert freeze_rate_of(memory) == freeze_rate_of(plan) == DEFAULT_FREEZE_RATE
    assert freeze_rate_of(_parser(PLAN).parse_args(["bert-tiny", "--batch", "2", "--lora", "4"])) == 0.0
    for command in (MEMORY, PLAN):
        assert f"default {DEFAULT_FREEZE_RATE:g}" in _parser(command).format_help()


def test_hidden_spellings_parse_as_the_canonical_flags():
    from slimfit.memory.cli import PLAN

    parser = _parser(PLAN)
    hidden = parser.parse_args(["bert-tiny", "--batch", "2", "--seq", "8", "--rate", "0.5", "--attn", "eager"])
    canonical = parser.parse_args(["bert-tiny", "--batch", "2", "--seq-len", "8", "--freeze-rate", "0.5",
                                   "--attn-implementation", "eager"])
    assert vars(hidden) == vars(canonical)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that `path` imports anywhere in it (function bodies included): for
    `from X import name`, X.name when that is a module, else X."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            source = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
    return found & modules


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph (a list of modules), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_inside_the_memory_package():
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    graph = {_module_name(p): _imports(p, modules) - {_module_name(p)} for p in paths}
    assert "slimfit.memory.plan.budget" in graph and graph["slimfit.memory.plan.budget"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    assert "slimfit.memory.plan.budget" not in graph["slimfit.memory.plan.step"]


def test_the_scheduler_does_not_import_the_memory_package():
    """The scheduler is pure Python below the memory package (its own per-layer estimate is scheduler/budget.py)."""
    scheduler = ROOT / "slimfit" / "scheduler"
    for path in sorted(scheduler.rglob("*.py")):
        modules = set(_module_name(p) for p in (ROOT / "slimfit").rglob("*.py"))
        assert not any(m.startswith("slimfit.memory") for m in _imports(path, modules)), path


def test_both_measurements_refuse_an_output_without_a_loss_naming_the_fix():
    from slimfit.memory import NoLossError, measure, measure_step

    model = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with pytest.raises(NoLossError, match="has no loss.*loss_fn="):
        measure_step(model, x)
    with pytest.raises(NoLossError, match="has no loss.*loss_fn="):
        measure(model, x)
    assert measure_step(model, x, loss_fn=lambda y: y.sum()).total > 0   # the sum, asked for explicitly


def test_public_paths_reach_the_same_objects():
    import slimfit
    import slimfit.architectures as archs
    import slimfit.plan
    import slimfit.step_memory
    from slimfit.memory import models, peak, plan, runs

    assert slimfit.memory.measure_step is slimfit.step_memory.measure_step is peak.measure_step
    assert set(slimfit.plan.__all__) == set(plan.__all__)
    assert all(getattr(slimfit.plan, n) is getattr(plan, n) for n in plan.__all__)
    assert archs.measure_step is runs.saved_of_step and archs.measure_step_peak is runs.peak_of_step
    assert archs.resolve is models.resolve and archs.ARCHITECTURES is models.ARCHITECTURES


def test_one_byte_formatter():
    from slimfit.memory import format_bytes, parse_bytes

    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.50 KiB"
    assert format_bytes(512, whole_bytes=False) == "0.50 KiB"
    assert format_bytes(3 * 2**29, 1) == "1.50 GiB" and format_bytes(3 * 2**19, 1) == "1.5 MiB"
    assert parse_bytes(format_bytes(3 * 2**29).replace(" ", "")) == 3 * 2**29
