"""`slimfit plan` at LLM scale: the shipped decoder configs, bf16 weights, batches that do not fit in memory
planned without allocating them, and the progress lines of --fit."""
from __future__ import annotations

import threading

import pytest
import torch

from slimfit import cli
from slimfit.memory import models
from slimfit.plan import StepSpec, measure, predict

# published parameter counts (the model cards) and whether the LM head is tied to the embedding
PUBLISHED = {"qwen2.5-0.5b": (0.494e9, True), "qwen2.5-1.5b": (1.54e9, True), "qwen2.5-7b": (7.62e9, False),
             "llama-3.2-1b": (1.24e9, True), "llama-3.2-3b": (3.21e9, True), "llama-3.1-8b": (8.03e9, False)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_decoder_configs_have_the_published_sizes(name):
    import transformers

    ref = models.resolve_model(name)
    with torch.device("meta"):
        model = getattr(transformers, ref.model_class)(ref.config)
    model.tie_weights()
    count, tied = PUBLISHED[name]
    assert abs(sum(p.numel() for p in model.parameters()) / count - 1) < 0.01
    assert ref.config.tie_word_embeddings is tied and name in models.known_names()


def test_bf16_weights_are_predicted_as_measured_and_autocast_keeps_fp32_weights():
    """dtype bf16 holds the model and AdamW's moments in bf16 (half of fp32); bf16-autocast keeps fp32 weights."""
    fp32, bf16, autocast = (StepSpec("llama-tiny", batch=2, seq=64, rate=0.0, dtype=d)
                            for d in ("fp32", "bf16", "bf16-autocast"))
    p32, p16, pauto = predict(fp32), predict(bf16), predict(autocast)
    assert p16.total == measure(bf16).total and pauto.total == measure(autocast).total
    assert 2 * p16.memory.weights == p32.memory.weights == pauto.memory.weights
    assert abs(2 * p16.memory.optimizer_state / p32.memory.optimizer_state - 1) < 0.001  # fp32 `step` scalars
    assert "bf16 weights" in bf16.label() and "bf16 autocast" in autocast.label()


class _PeakRSS:
    """The process's resident memory sampled every 5 ms while active: its rise over the value at entry."""

    def __enter__(self):
        import psutil

        self.process, self.stop = psutil.Process(), threading.Event()
        self.start = self.peak = self.process.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.rise = max(self.peak, self.process.memory_info().rss) - self.start


def test_a_batch_larger_than_the_machine_plans_and_allocates_little():
    """bert-tiny at batch 4M, seq 128: its token ids alone are 4 GiB and its activations hundreds of GiB; the
    plan's batch is fake (the labels real: 8 bytes a sequence) and nothing of the activations' size is real."""
    pytest.importorskip("psutil")
    import psutil

    spec = StepSpec("bert-tiny", batch=2**22, seq=128, rate=0.0)
    with _PeakRSS() as rss:
        p = predict(spec)
    assert p.total > psutil.virtual_memory().total and p.memory.saved > 50 * 2**30
    assert rss.rise < 512 * 2**20, rss.rise


def test_an_8b_decoder_at_s8192_plans_in_bf16_without_allocating():
    """Llama-3.1-8B's shape (two of its 32 layers: the test's time) at seq 8192 in bf16 weights: the
    embedding and head alone are 2 GiB of weights, the logits 2 GiB; the process grows by far less."""
    spec = StepSpec("llama-3.1-8b", batch=1, seq=8192, dtype="bf16", layers=2, rate=0.0)
    with _PeakRSS() as rss:
        p = predict(spec)
    embed_and_head = 2 * 128256 * 4096 * 2
    assert p.memory.weights > embed_and_head and p.total > 4 * 2**30
    assert rss.rise < 512 * 2**20, rss.rise


def test_plan_dtype_flag_means_weights(capsys):
    """(--fit's progress on stderr: tests/plan/test_fit.py)"""
    assert cli.main(["plan", "llama-tiny", "--batch", "1", "--seq", "16", "--dtype", "bf16", "--rate", "0"]) == 0
    assert "bf16 weights" in capsys.readouterr().out
    assert cli.main(["plan", "llama-tiny", "--batch", "1", "--seq", "16", "--dtype", "bf16-autocast"]) == 0
    assert "bf16 autocast" in capsys.readouterr().out
