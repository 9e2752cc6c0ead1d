#!/usr/bin/env python
"""The decoder accuracy protocol: SmolLM2-135M-Instruct (offline GGUF) fine-tuned on Rotten Tomatoes as an
instruction, full fine-tuning against slimfit, seeds 0-2; held-out answer loss and accuracy.

    python -m bench.decoder_accuracy                  # appends to bench/results/decoder_accuracy_cpu.csv
                                                      # (resumable: runs already there are skipped), rewrites .md
    python -m bench.decoder_accuracy --quick          # a tiny random Llama, 3 steps: the pipeline only, writes nothing
    python -m bench.decoder_accuracy --render-only

Each run: the pretrained model copied, `--steps` AdamW steps of `--batch-size` prompts (the loss on the answer
tokens only: slimfit.demo.decoder), the same seeded batches for every method; then on the held-out reviews the
mean answer loss (cross-entropy of " positive" / " negative" after the prompt) and the accuracy (the answer with
the higher log-likelihood). Methods: full (plain PyTorch) and slimfit presets with ILSScheduler at a rate
(`paper@0.7`: slimfit.patch(paper()) + ILSScheduler(freeze_rate=0.7)); `+q8` holds the frozen layers' AdamW
state 8-bit (SchedulerConfig.frozen_state="compress"). Target (issue #28): slimfit within 1% relative of full
fine-tuning's held-out loss, or within 1 point of its accuracy, over the same seeds.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/decoder_accuracy.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import copy
import statistics
import sys

import torch

from bench import _results

FIELDS = ["method", "seed", "steps", "batch_size", "lr", "max_length", "n_train", "n_test", "heldout_loss",
          "accuracy", "step_ms", "frozen_share", "device", "torch", "date", "commit"]


def _method(spec: str) -> tuple[str | None, float, dict]:
    """'full' -> (None, 0, {}); 'paper@0.7+q8' -> ('paper', 0.7, {'frozen_state': 'compress'}): the accuracy
    benchmark's spec names (bench/accuracy.parse_spec), the preset None for full fine-tuning."""
    from bench.accuracy import parse_spec

    name, rate, options = parse_spec(spec)
    if name == "full":
        return None, 0.0, {}
    # frozen_state=None unless +q8 / +offload, as in bench/accuracy.py
    return name, 0.7 if rate is None else rate, {"frozen_state": None, **options}


@torch.no_grad()
def heldout_loss(model, enc, test, batch_size: int = 16) -> float:
    """Mean cross-entropy of the right answer's tokens after each held-out prompt (eval mode)."""
    model.eval()
    total, tokens = 0.0, 0
    for i in range(0, len(test), batch_size):
        batch = enc.train_batch(test[i:i + batch_size])
        n = int((batch["labels"][:, 1:] != -100).sum())
        total += float(model(**batch).loss) * n
        tokens += n
    return total / max(tokens, 1)


def run_one(base_model, tokenizer, train, test, spec: str, seed: int, args) -> dict:
    from slimfit.demo.decoder import PromptEncoder, evaluate_decoder
    from slimfit.demo.finetune import prepare_preset, train_and_evaluate

    enc = PromptEncoder(tokenizer, args.max_length)
    preset, rate, options = _method(spec)
    torch.manual_seed(seed)
    model = copy.deepcopy(base_model)
    model.train()
    prepared = prepare_preset(preset, rate, scheduler_options=options)(model, seed)
    measured = {}

    def evaluate(m):
        measured["loss"] = heldout_loss(m, enc, test)
        return evaluate_decoder(m, enc, test, progress=False)

    result = train_and_evaluate(prepared, lambda idx: enc.train_batch([train[i] for i in idx]), len(train),
                                steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=seed, device="cpu",
                                progress=False, evaluate_fn=evaluate)
    versions = _results.versions()
    return {"method": spec, "seed": str(seed), "steps": str(args.steps), "batch_size": args.batch_size, "lr": args.lr,
            "max_length": args.max_length, "n_train": len(train), "n_test": len(test),
            "heldout_loss": f"{measured['loss']:.5f}", "accuracy": f"{result.accuracy:.4f}",
            "step_ms": f"{result.step_ms:.0f}", "frozen_share": f"{result.frozen_share:.3f}",
            "device": _results.device_name("cpu"), "torch": versions["torch"], "date": _results.now(),
            "commit": _results.commit_label()}


def markdown(rows: list[dict]) -> str:
    """Per method: mean ± std of held-out loss and accuracy, and the differences with full fine-tuning over
    the seeds both have."""
    full = {r["seed"]: r for r in rows if r["method"] == "full"}
    lines = ["# Decoder accuracy: SmolLM2-135M-Instruct on Rotten Tomatoes as an instruction", "",
             f"`{_results.command('decoder_accuracy', [])}`; rows: decoder_accuracy_cpu.csv. Target: within 1% "
             "relative of full fine-tuning's held-out loss, or 1 point of its accuracy.", ""]
    body = []
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        loss = [float(r["heldout_loss"]) for r in mine]
        acc = [100 * float(r["accuracy"]) for r in mine]
        both = [r for r in mine if r["seed"] in full]
        dloss = [float(r["heldout_loss"]) / float(full[r["seed"]]["heldout_loss"]) - 1 for r in both]
        dacc = [100 * (float(r["accuracy"]) - float(full[r["seed"]]["accuracy"])) for r in both]
        body.append([method, ",".join(r["seed"] for r in mine), _mean_std(loss, ".4f"), _mean_std(acc, ".2f"),
                     f"{100 * statistics.mean(dloss):+.2f}%" if dloss else "-",
                     f"{statistics.mean(dacc):+.2f}" if dacc else "-", mine[0]["steps"]])
    lines += _results.md_table(["method", "seeds", "held-out loss", "accuracy %", "loss vs full", "points vs full",
                                "steps"], body, right=range(2, 7))
    return "\n".join(lines) + "\n"


def _mean_std(values: list[float], fmt: str) -> str:
    if len(values) < 2:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


def _assets(args):
    from slimfit.demo.assets import load_data
    from slimfit.demo.decoder import load_smollm2

    train, test = load_data("rotten_tomatoes", 0, args.n_train, args.n_test)  # one split for every seed
    if args.quick:
        return _tiny(), train[:32], test[:16]
    model, tokenizer = load_smollm2(progress=False)
    return (model, tokenizer), train, test


class _WordHashTokenizer:
    """Words (with their leading space) and newlines -> ids 3..258 by CRC; 0 = padding: --quick needs no asset."""
    pad_token_id = 0
    eos_token_id = 1

    def encode(self, text, add_special_tokens=False):
        import re
        import zlib

        return [3 + zlib.crc32(w.encode()) % 256 for w in re.findall(r"\n| ?[^\s]+", text)]


def _tiny():
    """A tiny random Llama (2 layers, width 32) and the word-hash tokenizer."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg), _WordHashTokenizer()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="full,paper@0.7")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--n-test", type=int, default=200)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--render-only", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch_size = 3, 2
    path = _results.results_path("decoder_accuracy", "csv", "cpu")
    done = [] if args.quick else _results.read_rows(path)
    if not args.render_only:
        (model, tokenizer), train, test = _assets(args)
        for seed in [int(s) for s in args.seeds.split(",")]:
            for spec in args.methods.split(","):
                if any(r["method"] == spec and r["seed"] == str(seed) and r["steps"] == str(args.steps)
                       for r in done):
                    continue
                row = run_one(model, tokenizer, train, test, spec, seed, args)
                print(f"{spec:20s} seed {seed}: loss {row['heldout_loss']} accuracy {row['accuracy']}", flush=True)
                done.append(row)
                if not args.quick:
                    _results.append_row(path, row, FIELDS)
    text = markdown(done)
    print(text)
    if not args.quick:
        _results.write_text(_results.results_path("decoder_accuracy", "md", "cpu"), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
