"""The README: at most 120 lines, the two commands, and every number generated from bench/results (a number
that differs from its result file fails here)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_is_short_and_has_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 120
    assert "bash scripts/setup.sh demo && .venv/bin/slimfit demo" in text
    assert "bash scripts/setup.sh test && .venv/bin/python -m pytest" in text


def test_readme_numbers_are_the_results_files():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_results.py"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
