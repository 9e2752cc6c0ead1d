"""The scheduler package's other public functions name a bad argument and its fix, instead of failing
deep inside (a TypeError from a comparison, a multi-tensor op, float(None)) or answering wrongly; the
Trainer callback checks its options when it is built; and the package's functions stay short."""
import ast
import pathlib
import types

import pytest
import torch
from _models import MLP, regression_data, tiny_bert

from slimfit.scheduler import (
    FrozenGradGuard,
    ILSScheduler,
    SchedulerConfig,
    compute_scores,
    estimate_activation_bytes,
    find_candidates,
    min_rate_for_budget,
    num_frozen,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_num_frozen_names_a_rate_that_is_not_a_number():
    with pytest.raises(ValueError, match=r"freeze_rate must be in \[0, 1\) \(a number.*got str '0.5'"):
        num_frozen("0.5", 10)
    with pytest.raises(ValueError, match="got bool True"):
        num_frozen(True, 10)
    with pytest.raises(ValueError, match="n_layers must be an int >= 0"):
        num_frozen(0.5, -1)


def test_min_rate_for_budget_names_bad_bytes():
    with pytest.raises(ValueError, match="bytes_ is empty"):
        min_rate_for_budget([], budget_bytes=10.0)
    with pytest.raises(ValueError, match=r"bytes_\[1\] must be a finite number of bytes >= 0"):
        min_rate_for_budget([1.0, float("nan")], budget_bytes=10.0)
    with pytest.raises(ValueError, match=r"bytes_\['b'\] must be a finite number"):
        min_rate_for_budget({"a": 1.0, "b": -3.0}, budget_bytes=10.0)
    with pytest.raises(ValueError, match="budget_bytes must be a finite number of bytes > 0, got str"):
        min_rate_for_budget([1.0], budget_bytes="100")
    with pytest.raises(ValueError, match="base_bytes must be a finite number of bytes >= 0"):
        min_rate_for_budget([1.0], budget_bytes=10.0, base_bytes=float("nan"))
    with pytest.raises(TypeError, match="per-layer activation bytes"):
        min_rate_for_budget(3, budget_bytes=10.0)
    with pytest.raises(ValueError, match="raise the budget or lower base_bytes"):
        min_rate_for_budget([100.0], budget_bytes=10.0)
    assert min_rate_for_budget((b for b in [100.0, 100.0]), budget_bytes=150.0) == 0.5


def test_estimate_activation_bytes_names_its_arguments():
    x = regression_data()[0]
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        estimate_activation_bytes(x, MLP())
    with pytest.raises(ValueError, match=r"norm_fraction must be a number in \[0, 1\]"):
        estimate_activation_bytes(MLP(), x, norm_fraction=9)


def test_an_activation_bytes_callable_that_returns_no_number_is_named():
    with pytest.raises(ValueError, match=r"activation_bytes\['fc1.weight'\] must be a finite number of bytes"):
        ILSScheduler(MLP(), activation_bytes=lambda name, p: None, memory_aware=True)
    sched = ILSScheduler(MLP(), activation_bytes=lambda name, p: torch.tensor(p.numel()), memory_aware=True)
    assert sched.trained_bytes() is not None        # a one-element tensor is a number of bytes


def test_compute_scores_names_the_layer_whose_snapshot_does_not_fit():
    olds, news = [torch.ones(4), torch.ones(2, 3)], [torch.ones(4), torch.ones(3, 2)]
    for impl in ("foreach", "blocked"):
        with pytest.raises(ValueError, match=r"layer 1: the snapshot \(shape \[2, 3\]\) and the weight \(shape \[3, "):
            compute_scores("relative", olds, news, impl=impl)
    with pytest.raises(ValueError, match="1 snapshots \\(olds\\) for 2 weights"):
        compute_scores("relative", olds[:1], news)
    with pytest.raises(ValueError, match="chunk_numel must be an int >= 1"):
        compute_scores("relative", olds[:1], news[:1], chunk_numel=0.5)
    with pytest.raises(ValueError, match="zero_flags has 1 entries for 2 layers"):
        compute_scores("relative", [torch.ones(4)] * 2, [torch.ones(4)] * 2, zero_flags=[False], impl="foreach")


def test_find_candidates_and_the_guard_name_wrong_arguments():
    with pytest.raises(TypeError, match=r"named_parameters\(\); got NoneType"):
        find_candidates(None)
    with pytest.raises(TypeError, match="got NoneType"):
        ILSScheduler(None)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="frozen_params must be a callable"):
        FrozenGradGuard(opt, [model.fc1.weight])
    with pytest.raises(TypeError, match="optimizer: expected a torch.optim.Optimizer"):
        ILSScheduler(model, 0.5, optimizer=object())
    assert all(p.requires_grad for p in model.parameters()) and not model._forward_pre_hooks


def test_trainer_callback_checks_its_options_when_built(tmp_path):
    pytest.importorskip("transformers")
    import slimfit
    from slimfit.scheduler import SlimFitCallback

    with pytest.raises(ValueError, match="SchedulerConfig.freeze_rate must be in"):
        SlimFitCallback(freeze_rate="0.9")
    with pytest.raises(TypeError, match="did you mean 'freeze_rate'"):
        SlimFitCallback(freez_rate=0.9)
    with pytest.raises(TypeError, match=r"pass a SchedulerConfig as SlimFitCallback\(scheduler="):
        SlimFitCallback(config=SchedulerConfig())
    with pytest.raises(TypeError, match="config must be a slimfit.SlimFitConfig"):
        SlimFitCallback(config={"gelu_bits": 4})
    with pytest.raises(TypeError, match="scheduler must be an ILSScheduler or a SchedulerConfig"):
        SlimFitCallback(scheduler=0.9)
    with pytest.raises(TypeError, match="resume_from must be a checkpoint folder"):
        SlimFitCallback(resume_from=3)
    assert SlimFitCallback(config=slimfit.SlimFitConfig.paper()).scheduler_config == SchedulerConfig()

    cb = SlimFitCallback(scheduler=SchedulerConfig(freeze_rate=0.5), seed=2)
    model = tiny_bert()
    args = types.SimpleNamespace(output_dir=str(tmp_path))
    cb.on_train_begin(args, types.SimpleNamespace(global_step=0), None, model=model)
    assert cb.scheduler.config == SchedulerConfig(freeze_rate=0.5, seed=2)

    missing = SlimFitCallback(freeze_rate=0.5, resume_from=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no slimfit_ils.pt in that folder"):
        missing.on_train_begin(args, types.SimpleNamespace(global_step=0), None, model=tiny_bert())
    resumed = SlimFitCallback(freeze_rate=0.5)
    with pytest.warns(UserWarning, match="starts afresh"):
        resumed.on_train_begin(args, types.SimpleNamespace(global_step=4), None, model=tiny_bert())


def test_every_function_of_the_scheduler_package_is_under_60_lines():
    long = []
    for f in sorted((ROOT / "slimfit" / "scheduler").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines >= 60:
                    long.append(f"{f.name}:{node.name} ({lines} lines)")
    assert not long, long
