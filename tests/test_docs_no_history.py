"""The library's docstrings and docs/*.md state what the code does now, not how it got there.

History belongs in git and in a changelog: a docstring or a doc page that says what a default "was
until 2026-11-24", what a name "formerly" meant or what was measured "in this session" goes stale the
day it is written. Lab-report numbers (seeds, accuracy points) belong in docs/fidelity.md and the
results under bench/results/; a docstring says what and why and links there. The failure names each
offending file:line with the phrase found.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Phrases that date a text or tell its history. Each is a regex, case-insensitive; the comment says
# what it leaves alone where the words have a present-tense meaning too.
HISTORY = [
    r"\buntil (?=\d)",                               # "the default until 2026-11-24"
    r"\b\d{4}-\d{2}-\d{2}\b",                        # a date
    r"\bformerly\b",
    r"\bearlier versions?\b",
    r"\bwas the default\b",
    r"(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bbeen )\bused to\b",   # not "is used to compute"
    r"\bpreviously\b",
    r"\bnow that\b",
    r"\bno longer\b(?! sums? to one)",               # not the arithmetic "P̃ no longer sums to one"
    r"\bsession\b",                                  # not gpu_session.sh (no word boundary there)
    r"\bmeasured before\b",
    r"\b(?:as|measured|ran|run|committed) before the\b",
    r"\btoday'?s?\b",
    r"\bany ?more\b",
    r"\bold name\b",
    r"(?:^|[.!?:]\s+)Before,",                         # a sentence opening on the past ("Before, ...")
    r"\bas before\b",
    r"(?<!\bit )\bis now\b",                          # not "the model as it is now" (its current state)
    r"\bissues? #?\d+",                               # tracker references: "issue 16", "Issue #27"
    r"(?<![\w&/])#\d{1,4}\b",                         # "#27's targets"
]
# In docstrings only: accuracy figures of a lab report (docs/fidelity.md holds them).
LAB_NUMBERS = [
    r"\bseeds? \d[\d,\- ]*:",                        # "seed 0: -4.8 points"
    r"[-+−]\d+(?:\.\d+)? points?\b",                 # "-4.8 points", "+0.10 points"
]
_HISTORY = re.compile("|".join(f"(?:{p})" for p in HISTORY), re.IGNORECASE)
_LAB = re.compile("|".join(f"(?:{p})" for p in HISTORY + LAB_NUMBERS), re.IGNORECASE)


def _docstrings(tree: ast.AST):
    """(first line number, text) of every module, class and function docstring."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                yield body[0].lineno, body[0].value.value


def _hits(text: str, first_line: int, pattern: re.Pattern) -> list[tuple[int, str]]:
    return [(first_line + i, m.group(0)) for i, line in enumerate(text.splitlines())
            for m in pattern.finditer(line)]


def _docstring_hits() -> list[str]:
    found = []
    for path in sorted((ROOT / "slimfit").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, text in _docstrings(tree):
            found += [f"{path.relative_to(ROOT)}:{n}: {phrase!r}" for n, phrase in _hits(text, line, _LAB)]
    return found


def _pages():
    """docs/*.md (a changelog aside) and the README: the pages a user reads."""
    pages = [p for p in sorted((ROOT / "docs").glob("*.md")) if "changelog" not in p.name.lower()]
    return pages + [ROOT / "README.md"]


def _doc_page_hits() -> list[str]:
    """History phrases on every page; lab numbers on every page but docs/fidelity.md, which holds them."""
    found = []
    for path in _pages():
        text = path.read_text(encoding="utf-8")
        pattern = _HISTORY if path.name == "fidelity.md" else _LAB
        found += [f"{path.relative_to(ROOT)}:{n}: {phrase!r}" for n, phrase in _hits(text, 1, pattern)]
    return found


def test_docstrings_state_the_present():
    found = _docstring_hits()
    assert not found, ("docstrings telling history or lab numbers (state the current behaviour; numbers go to "
                       "docs/fidelity.md):\n" + "\n".join(found))


def test_doc_pages_state_the_present():
    found = _doc_page_hits()
    assert not found, ("docs/*.md or README.md telling history, citing the tracker or quoting lab numbers outside "
                       "docs/fidelity.md (state the current behaviour; link fidelity.md):\n" + "\n".join(found))


def test_the_scan_catches_what_it_is_for():
    doc = '"""Default 0.9 until 2026-11-24, formerly paper_topk; Fashion-MNIST seed 0: -4.8 points."""'
    (line, text), = _docstrings(ast.parse(doc))
    assert [p for _, p in _hits(text, line, _LAB)] == ["until ", "2026-11-24", "formerly", "seed 0:",
                                                        "-4.8 points"]
    assert _hits("it is used to compute x; P no longer sums to one; scripts/gpu_session.sh", 1, _HISTORY) == []
    assert [p for _, p in _hits("it used to fail; measured in this session", 1, _HISTORY)] == ["used to",
                                                                                                 "session"]
    page = "Before, it froze all. It works as before; the default is now 8-bit (issue 16, #27's target)."
    assert [p.strip() for _, p in _hits(page, 1, _HISTORY)] == ["Before,", "as before", "is now", "issue 16",
                                                                 "#27"]
    assert _hits("the model as it is now; see [the table](#short-runs); beforehand", 1, _HISTORY) == []
