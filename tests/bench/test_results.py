"""bench/_results.py: results paths, CSV rows (append, skip-if-present, merge), tables, commands."""
from __future__ import annotations

import os

import pytest

from bench import _results


def test_results_paths_and_device_tags(tmp_path):
    assert _results.device_tag("cpu") == "cpu"
    assert _results.device_tag("cuda:0") == _results.device_tag("cuda") == "gpu"
    torch = pytest.importorskip("torch")
    assert _results.device_tag(torch.device("cpu")) == "cpu"
    assert _results.results_path("e2e", "md", "cuda") == os.path.join(_results.RESULTS_DIR, "e2e_gpu.md")
    assert _results.results_path("accuracy_text", "csv", "cpu", str(tmp_path)) == str(tmp_path /
                                                                                     "accuracy_text_cpu.csv")
    assert _results.results_path("kernels_static_sm90", "md") == os.path.join(_results.RESULTS_DIR,
                                                                              "kernels_static_sm90.md")
    assert _results.results_path("attention_memory", "", "cpu").endswith(os.sep + "attention_memory_cpu")


def test_command_is_the_file_form_with_quoted_arguments():
    assert _results.command("accuracy", ["--task", "text"]) == "python bench/accuracy.py --task text"
    assert _results.command("seq_sweep", ["--models", "smollm2-135m:512,1024", "--seqs", 128]) == \
        "python bench/seq_sweep.py --models smollm2-135m:512,1024 --seqs 128"
    assert _results.command("op_count", ["--commit", "a b"]) == "python bench/op_count.py --commit 'a b'"
    assert _results.command("grad_fidelity", []) == "python bench/grad_fidelity.py"


def test_append_read_and_skip_if_present(tmp_path):
    """bench/accuracy.py's rule: a (method, seed, settings) row already in the CSV is not run again; values
    compare as the strings the CSV holds."""
    path = str(tmp_path / "sub" / "rows.csv")
    assert _results.read_rows(path) == []
    fields = ["method", "seed", "steps", "accuracy"]
    _results.append_row(path, {"method": "full", "seed": 0, "steps": 150, "accuracy": "0.8"}, fields)
    _results.append_row(path, {"method": "paper@0.9", "seed": 1, "steps": 150, "accuracy": "0.7"}, fields)
    rows = _results.read_rows(path)
    assert [r["method"] for r in rows] == ["full", "paper@0.9"] and rows[1]["seed"] == "1"
    with open(path) as fh:
        assert fh.read().count("method,seed") == 1  # one header
    assert any(_results.matches(r, method="full", seed=0, steps=150) for r in rows)
    assert not any(_results.matches(r, method="full", seed=1, steps=150) for r in rows)
    assert not any(_results.matches(r, method="full", seed=0, steps=500) for r in rows)


def test_merge_replaces_in_place_and_appends_new_keys():
    old = [{"m": "a", "v": "1"}, {"m": "b", "v": "2"}, {"m": "c", "v": "3"}]
    new = [{"m": "d", "v": "40"}, {"m": "b", "v": "20"}]
    assert _results.merge_rows(old, new, key=("m",)) == [{"m": "a", "v": "1"}, {"m": "b", "v": "20"},
                                                          {"m": "c", "v": "3"}, {"m": "d", "v": "40"}]
    assert _results.merge_rows([], new, key=lambda r: r["m"]) == new


def test_write_rows_of_dicts_and_of_lists(tmp_path):
    a, b = str(tmp_path / "a.csv"), str(tmp_path / "b.csv")
    _results.write_rows(a, [{"x": 1, "y": None}, {"x": 2, "y": "z"}])
    _results.write_rows(b, [[1, None], [2, "z"]], ["x", "y"])
    assert open(a, newline="").read() == open(b, newline="").read() == "x,y\r\n1,\r\n2,z\r\n"


def test_tables():
    assert _results.md_table(["name", "n"], [["a|b", 1], ["c", 22]], right={1}) == [
        "| name | n |", "|---|---:|", "| a\\|b | 1 |", "| c | 22 |"]
    assert _results.text_table(["name", "n"], [["a", "1"], ["ccc", "22"]], right={1}) == [
        "name   n", "----  --", "a      1", "ccc   22"]


def test_a_table_to_compare_with_comes_from_a_file_or_from_git_history(tmp_path):
    path = tmp_path / "other.csv"
    _results.write_rows(str(path), [{"kernel": "quantize", "regs": "32"}], ["kernel", "regs"])
    assert _results.read_compare_rows(str(path)) == [{"kernel": "quantize", "regs": "32"}]
    with pytest.raises(SystemExit, match="REV:PATH"):
        _results.read_compare_rows(str(tmp_path / "missing.csv"))
    if not os.path.isdir(os.path.join(_results.ROOT, ".git")):
        pytest.skip("not a git checkout: REV:PATH cannot be read")
    rows = _results.read_compare_rows("HEAD:bench/results/kernels_static_sm90.csv")
    assert rows and {"backend", "kernel", "variant", "regs", "per_elem"} <= set(rows[0])
    with pytest.raises(SystemExit, match="git cannot show it"):
        _results.read_compare_rows("HEAD:bench/results/no_such_table.csv")


def test_no_before_copies_among_the_results():
    """Comparisons with another run come from git history or an explicit --compare / --before file, never
    from a *_before copy kept beside the results: kernels_static's --compare has no default."""
    from bench import kernels_static

    assert [n for n in sorted(os.listdir(_results.RESULTS_DIR)) if "_before." in n] == []
    assert kernels_static.parser().get_default("compare") is None


def test_append_row_rewrites_a_file_whose_header_lacks_a_new_field(tmp_path):
    """A column added since the file was written: the old rows get it empty, the new row's cells stay in their
    columns (appending under the old header shifted every later cell)."""
    from bench import _results

    path = str(tmp_path / "r.csv")
    _results.append_row(path, {"a": "1", "c": "3"}, ["a", "c"])
    _results.append_row(path, {"a": "4", "b": "5", "c": "6"}, ["a", "b", "c"])
    assert _results.read_rows(path) == [{"a": "1", "b": "", "c": "3"}, {"a": "4", "b": "5", "c": "6"}]
    with pytest.raises(ValueError, match="not among the fields"):
        _results.append_row(path, {"a": "7"}, ["a"])
