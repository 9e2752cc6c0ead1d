"""TRL's SFTTrainer with slimfit: the usual way decoder LLMs are fine-tuned, one callback patching and scheduling.

A tiny Llama (no downloads) and a word-level tokenizer built here; the dataset is already tokenized, with a
padded row, so SFTTrainer's collator pads and masks. Checked: the model is patched (chunked LM loss, SwiGLU,
RMSNorm), the loss SFTTrainer logs is finite and falls, the weights the scheduler froze stood still over each
step while trained ones moved, and the loss of the patched model equals the plain model's own on the same
batch (exact() changes no value).
"""
import copy

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

import slimfit  # noqa: E402
from slimfit import SlimFitConfig  # noqa: E402
from slimfit.scheduler import SlimFitCallback  # noqa: E402

VOCAB = 97


def _tokenizer():
    from tokenizers import Tokenizer, models

    words = {f"w{i}": i for i in range(VOCAB)}
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="w1")),
                                               pad_token="w0", eos_token="w2", unk_token="w1")
    return tok


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                   pad_token_id=0, eos_token_id=2)
    return transformers.LlamaForCausalLM(cfg)


def _dataset(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, VOCAB, (int(torch.randint(6, 17, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]
    return datasets.Dataset.from_dict({"input_ids": rows})


class _FrozenStandStill(transformers.TrainerCallback):
    """Before SlimFitCallback: the weights frozen in a step are the same after it; some trained ones moved."""

    def __init__(self, ils):
        self.ils, self.moved, self.before = ils, set(), {}

    def on_step_begin(self, args, state, control, **kwargs):
        s = self.ils.scheduler
        self.before = {n: (p.requires_grad, p.detach().clone()) for n, p in zip(s.names, s.params)}

    def on_step_end(self, args, state, control, **kwargs):
        s = self.ils.scheduler
        for n, p in zip(s.names, s.params):
            trained, old = self.before[n]
            if not trained:
                assert torch.equal(p, old), n
            elif not torch.equal(p, old):
                self.moved.add(n)


def test_sft_trainer_patches_schedules_and_trains(tmp_path):
    model = _model()
    ils = SlimFitCallback(freeze_rate=0.5, config=SlimFitConfig.paper())
    check = _FrozenStandStill(ils)
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4, learning_rate=3e-3,
                         logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=_dataset(), processing_class=_tokenizer(),
                             callbacks=[check, ils])
    summary = str(trainer.model.slimfit_summary)
    assert "causal-lm loss" in summary and "swiglu" in summary and "rmsnorm" in summary
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert check.moved and ils.scheduler.closed
    assert any("slimfit_frozen_share" in log for log in trainer.state.log_history)


def test_sft_collated_batch_loss_equals_the_plain_models():
    """exact(): the patched model's loss and gradients on an SFTTrainer batch (padding masked with -100) are the
    plain one's (the chunked LM loss sums in another order: within fp32 rounding)."""
    plain = _model()
    patched = slimfit.patch(copy.deepcopy(plain), SlimFitConfig.exact())
    args = trl.SFTConfig(output_dir="unused", per_device_train_batch_size=4, report_to=[], use_cpu=True)
    trainer = trl.SFTTrainer(model=copy.deepcopy(plain), args=args, train_dataset=_dataset(),
                             processing_class=_tokenizer())
    batch = next(iter(trainer.get_train_dataloader()))
    assert (batch["labels"] == -100).any()  # a padded row: the mask reaches the loss
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels")}
    plain.train(), patched.train()
    loss, ref = patched(**inputs).loss, plain(**inputs).loss
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-6)
    loss.backward(), ref.backward()
    for (name, p), q in zip(patched.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
