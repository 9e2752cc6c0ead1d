"""bench/ is a package: every script imports as `bench.<name>` and has a `main`, none edits sys.path
(only bench/_shim.py, for the file form `python bench/<name>.py`), and both forms run."""
from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_"))
GUARD = ('if __name__ == "__main__" and not __package__:', "    import _shim", "    _shim.run_as_module(__file__)")


def test_the_scripts_are_the_ones_bench_readme_lists():
    assert len(SCRIPTS) >= 13 and "accuracy" in SCRIPTS and "kernels_static" in SCRIPTS
    readme = (BENCH / "README.md").read_text()
    assert [s for s in SCRIPTS if f"`{s}.py`" not in readme] == []


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports_as_bench_module_with_main(name):
    pytest.importorskip("transformers")
    module = importlib.import_module(f"bench.{name}")
    assert module.__name__ == f"bench.{name}" and module.__package__ == "bench"
    assert callable(getattr(module, "main", None)), f"bench/{name}.py has no main()"


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_starts_with_the_file_form_guard(name):
    """The guard comes before any import but __future__'s, so `python bench/<name>.py` never imports
    `bench` from the wrong place."""
    source = (BENCH / f"{name}.py").read_text()
    tree = ast.parse(source)
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    body = [n for n in body if not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
    assert isinstance(body[0], ast.If), f"bench/{name}.py: the file-form guard must come first"
    lines = source.splitlines()[body[0].lineno - 1:body[0].end_lineno]
    assert lines[0].startswith(GUARD[0]) and tuple(lines[1:]) == GUARD[1:]


def _edits_sys_path(tree: ast.AST) -> list[int]:
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name)
            and n.value.id == "sys"]


def test_no_bench_file_touches_sys_path_but_the_shim():
    offenders = {}
    for path in sorted(BENCH.rglob("*.py")):
        if path.name == "_shim.py":
            continue
        lines = _edits_sys_path(ast.parse(path.read_text()))
        if lines:
            offenders[str(path.relative_to(ROOT))] = lines
    assert offenders == {}
    assert _edits_sys_path(ast.parse((BENCH / "_shim.py").read_text()))  # the one place, so the check can see


def _run(args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_module_form_and_file_form_run_the_same_script(tmp_path):
    """kernels_static imports nothing heavy at the top: --help shows both forms reach its argument parser,
    the file form from any folder, and its exit status passes through the shim."""
    as_module = _run(["-m", "bench.kernels_static", "--help"], cwd=ROOT)
    assert as_module.returncode == 0, as_module.stderr
    as_file = _run([str(BENCH / "kernels_static.py"), "--help"], cwd=tmp_path)
    assert as_file.returncode == 0, as_file.stderr
    assert as_file.stdout == as_module.stdout and "--from-csv" in as_file.stdout
    bad = _run([str(BENCH / "kernels_static.py"), "--no-such-option"], cwd=tmp_path)
    assert bad.returncode == 2 and "unrecognized arguments" in bad.stderr
