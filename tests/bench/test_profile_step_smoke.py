"""bench.profile_step: one frontier row profiled on a 2-layer model; the table names the ops that ran."""
from bench import profile_step


def test_quick_profile_lists_the_ops_of_the_step(capsys):
    assert profile_step.main(["--case", "bert-16", "--method", "slimfit-paper", "--quick", "--steps", "1",
                              "--warmup", "0", "--rows", "40"]) == 0
    out = capsys.readouterr().out
    assert "## bert-16, slimfit-paper, fp32, 1 steps profiled" in out
    assert "aten::mm" in out or "aten::addmm" in out
    assert "slimfit::quantize" in out   # paper() stores activations through slimfit's kernels
