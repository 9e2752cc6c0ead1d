"""No function of the library is longer than 60 lines: a longer one is split into helpers whose names
say what each part does. A function's length runs from its `def` line to its last line (docstring,
comments and blank lines included, decorators not); nested functions count in their parent too.
The failure names each function over the limit as file:line name (lines)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 60


def function_lengths(source: str):
    """(line, qualified name, lines) of every function and method in `source`."""
    out = []

    def visit(node, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((child.lineno, name, child.end_lineno - child.lineno + 1))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def test_no_function_in_slimfit_is_longer_than_60_lines():
    too_long = []
    for path in sorted((ROOT / "slimfit").rglob("*.py")):
        for line, name, n in function_lengths(path.read_text(encoding="utf-8")):
            if n > MAX_LINES:
                too_long.append(f"{path.relative_to(ROOT)}:{line} {name} ({n} lines)")
    assert not too_long, (f"functions over {MAX_LINES} lines (split them into helpers with names that say what "
                          "each part does):\n" + "\n".join(too_long))


def test_the_count_runs_from_def_to_the_last_line():
    source = "class A:\n    @staticmethod\n    def f():\n        def g():\n            pass\n\n        return 1\n"
    assert function_lengths(source) == [(3, "A.f", 5), (4, "A.f.g", 2)]
