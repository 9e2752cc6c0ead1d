"""slimfit's benchmarks, one module a script, run from the repository root:

    python -m bench.<name> [options]          # e.g. python -m bench.accuracy --quick
    python bench/<name>.py [options]          # the same module (the file form, bench/_shim.py)

Shared modules: _timing (the median of many runs), _results (results paths, CSV rows, Markdown and
text tables, the machine and versions for result headers), assets/ (data and models only the
benchmarks and their tests use). bench/ is not installed with slimfit; bench/README.md lists the
scripts and what they write under bench/results/.
"""
