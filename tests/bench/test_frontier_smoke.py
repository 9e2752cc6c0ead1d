"""bench/frontier.py: the quick run measures every asked method and the table names, for every peer, the
slimfit rows with no more step peak and no more step time (or says none)."""
from bench import frontier


def test_quick_run_prints_the_frontier_table(capsys):
    assert frontier.main(["--quick", "--cases", "bert-16", "--methods", "sdpa,lora-r8,slimfit-paper"]) == 0
    out = capsys.readouterr().out
    assert "## bert-base, batch 2, seq 32" in out
    for method in ("sdpa", "lora-r8", "slimfit-paper"):
        assert f"| {method} |" in out


def test_dominating_rows_have_no_more_peak_and_time():
    rows = [{"case": "c", "method": "sdpa", "step_peak_mib": "100", "step_s": "1.0"},
            {"case": "c", "method": "slimfit-a", "step_peak_mib": "90", "step_s": "0.9"},
            {"case": "c", "method": "slimfit-b", "step_peak_mib": "80", "step_s": "1.1"},
            {"case": "d", "method": "slimfit-c", "step_peak_mib": "10", "step_s": "0.1"},
            {"case": "c", "method": "lora", "step_peak_mib": "", "step_s": "0.5"}]
    assert [r["method"] for r in frontier.dominating(rows[0], rows)] == ["slimfit-a"]
    assert frontier.dominating(rows[4], rows) == []  # a peer without a peak: nothing to compare
    for row in rows:
        row.update(model="m", batch=1, seq=8, status="ok", optimizer_mib="1")
    text = frontier.markdown(rows, "# t")
    assert "| sdpa | 100 | 1.00x | 1.00 | 1.00x | 1 | slimfit-a |" in text
    assert "| lora | - | - | 0.50 | - | - | ok |" in text
