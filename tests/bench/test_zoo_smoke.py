"""bench/zoo.py --quick: three narrow architectures measured; every row has its ratios (the first frozen set's and
at the rate's average) and names what paper() keeps most."""
from bench import zoo


def test_quick_run_rows_name_what_is_kept(capsys):
    assert zoo.main(["--quick"]) == 0
    out = capsys.readouterr().out
    for name in zoo.QUICK:
        line = next(line for line in out.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[-1] == "ok" and float(cells[4].split("x")[0]) > 1.0 and "%" in cells[8]
        assert float(cells[5].split("x")[0]) > 1.0   # at the rate's average
