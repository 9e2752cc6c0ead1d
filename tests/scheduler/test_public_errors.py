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


def _train_one_step(model, opt, sched):
    x, y = regression_data()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()


def test_a_second_scheduler_on_one_optimizer_is_refused_naming_the_first():
    """Issue #38: two schedulers on one optimizer hooked the same step (the second's chunked step found no
    gradient left: its layers scored 0) without a word. The second is refused, named, with the fixes."""
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = ILSScheduler(model, 0.5, optimizer=opt, layers=["fc1.weight", "fc2.weight"])
    flags = [p.requires_grad for p in model.parameters()]
    with pytest.raises(ValueError, match=rf"attached already to ILSScheduler\(layers=2.*at {id(first):#x}, which "
                                         r"schedules fc1.weight, fc2.weight.*close\(\).*optimizer=None"):
        ILSScheduler(model, 0.5, optimizer=opt, layers=["head.weight", "ln1.weight"])
    assert [p.requires_grad for p in model.parameters()] == flags and len(model._forward_pre_hooks) == 0
    late = ILSScheduler(model, 0.5, layers=["head.weight", "ln1.weight"])
    with pytest.raises(ValueError, match="attached already to ILSScheduler"):
        late.attach_optimizer(opt)
    del late                                                # alive, it would start at the next forward
    other = ILSScheduler(model, 0.5, optimizer=None, layers=["head.weight", "ln1.weight"])   # the first fix
    _train_one_step(model, opt, first)
    other.step()
    first.close()                                                                              # the second
    again = ILSScheduler(model, 0.5, optimizer=opt, layers=["ln2.weight"])
    _train_one_step(model, opt, again)
    assert again.step_count == 1


def test_the_same_layers_under_two_schedulers_are_refused_whatever_the_optimizers():
    """The same model scheduled twice (two optimizers, or none): both would flip the same requires_grad, so the
    one that starts second is refused (at construction with an optimizer, else at its first frozen set); a
    scheduler built and never started (to read its names or first decision) claims nothing."""
    model = MLP()
    reader = ILSScheduler(model, 0.5)                       # never started: no claim
    first_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = ILSScheduler(model, 0.5, optimizer=first_opt)
    assert reader.names == first.names
    with pytest.raises(ValueError, match=rf"of these layers \(fc1.weight.*scheduled already by ILSScheduler"
                                         rf"\(layers=3.* at {id(first):#x}, which schedules fc1.weight, "
                                         r"fc2.weight, head.weight.*close\(\)"):
        ILSScheduler(model, 0.5, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    with pytest.raises(ValueError, match="scheduled already by"):
        reader.apply()                                      # it would start now
    with pytest.raises(ValueError, match="scheduled already by"):
        model(regression_data()[0])                         # its first-forward hook starts it
    first.close()
    del reader
    second_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    second = ILSScheduler(model, 0.5, optimizer=second_opt)
    _train_one_step(model, second_opt, second)
    assert second.step_count == 1


def test_a_scheduler_dropped_without_close_is_cleaned_up_by_the_next_with_warnings():
    """Its chunked step stayed on the optimizer and took every gradient first (the next scheduler's layers
    scored 0); the next one attached there takes it off, and names the layers it left frozen."""
    import gc

    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dropped = ILSScheduler(model, 0.5, optimizer=opt, warmup_steps=0)
    _train_one_step(model, opt, dropped)
    left = dropped.frozen_names()
    del dropped
    gc.collect()
    with pytest.warns(UserWarning, match="dropped without close") as caught:
        sched = ILSScheduler(model, 0.5, optimizer=opt, warmup_steps=0)
    texts = " ".join(str(w.message) for w in caught)
    assert f"{len(left)} parameters ({left[0]}" in texts and "chunked step and held optimizer state" in texts
    for _ in range(2):
        _train_one_step(model, opt, sched)
    assert all(0 < s < 1e6 for s in sched.layer_scores().values())   # scored, not 0 (nor the initial 1e6+)
