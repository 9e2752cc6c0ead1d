#!/usr/bin/env python
"""The decoder accuracy protocols: SmolLM2-135M-Instruct (offline GGUF) fine-tuned on a text task as an
instruction, full fine-tuning against slimfit, seeds 0-2; held-out answer loss and accuracy.

    python -m bench.decoder_accuracy                  # appends to bench/results/decoder_accuracy_cpu.csv
                                                      # (resumable: runs already there are skipped), rewrites .md
    python -m bench.decoder_accuracy --task fortunes  # the 16-answer protocol: bench/results/decoder_fortunes_cpu.*
    python -m bench.decoder_accuracy --quick          # a tiny random Llama, 3 steps: the pipeline only, writes nothing
    python -m bench.decoder_accuracy --render-only

Each run: the pretrained model copied, `--steps` AdamW steps of `--batch-size` prompts (the loss on the answer
tokens only: slimfit.demo.decoder), the same seeded batches for every method; then on the held-out texts the
mean answer loss (cross-entropy of the right answer's tokens after the prompt) and the accuracy (the answer with
the highest log-likelihood among the task's answers). Methods: full (plain PyTorch) and slimfit presets with
ILSScheduler at a rate (`paper@0.7`: slimfit.patch(paper()) + ILSScheduler(freeze_rate=0.7)); `+q8` holds the
frozen layers' AdamW state 8-bit (SchedulerConfig.frozen_state="compress"), `+q8all` every layer's (the
default, "compress_all"); the names of bench/accuracy.parse_spec.

Tasks (`--task`; flags left unset take the task's defaults, TASKS):

* `rotten_tomatoes` (default): "Review: ...\nIs this movie review positive or negative?\nAnswer:", answers
  " positive" / " negative"; 60 steps of batch 4, lr 5e-5, <= 64 tokens, 200 held-out reviews. Target
  (issue #28): slimfit within 1% relative of full fine-tuning's held-out loss, or within 1 point of its
  accuracy, over the same seeds.
* `fortunes`: Debian fortunes' 16 largest topic files (slimfit.demo.assets.fortunes), "Fortune: ...\nWhich
  topic is this fortune from? Answer:", the answer a word naming the topic, one SmolLM2 token each and all
  distinct (FORTUNE_TOPICS); 40 steps of batch 8, lr 5e-5, <= 96 tokens (91% of the fortunes whole), a
  balanced held-out set (10 fortunes per topic, 160), the zero-shot model scored too. A short fine-tune with
  many answers: where freezing most weight matrices from the first step shows (issue #38). Rows record the
  train loss of every step and the run's wall time.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/decoder_accuracy.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import contextlib
import copy
import statistics
import sys
import time

import torch

from bench import _results

FIELDS = ["method", "seed", "steps", "batch_size", "lr", "max_length", "n_train", "n_test", "heldout_loss",
          "accuracy", "step_ms", "frozen_share", "device", "torch", "date", "commit"]
# the fortunes protocol's rows: the share of texts kept whole, the train loss (the mean of the first / last 10
# steps, then every step's), the run's and the evaluation's wall time
FORTUNE_FIELDS = FIELDS[:12] + ["whole_share", "train_loss_first10", "train_loss_last10", "run_s", "eval_s"] \
    + FIELDS[12:] + ["train_losses"]
TASKS = {
    "rotten_tomatoes": dict(results="decoder_accuracy", fields=FIELDS, methods="full,paper@0.7", steps=60,
                            batch_size=4, lr=5e-5, max_length=64, n_train=2000, n_test=200),
    "fortunes": dict(results="decoder_fortunes", fields=FORTUNE_FIELDS, methods="full,paper@0.7+q8all", steps=40,
                     batch_size=8, lr=5e-5, max_length=96, n_train=2000, n_test=160),
}
# Debian fortunes' 16 largest topic files in label order (assets.fortunes: the largest first; fortunes
# 1:1.99.1) and the answer naming each: one SmolLM2 token each, all distinct (a topic whose name is not one
# word gets a word for its content: songs-poems, miscellaneous, men-women, zippy (Zippy the Pinhead),
# knghtbrd (IRC quotes), platitudes).
FORTUNE_TOPICS = (("people", " people"), ("definitions", " definitions"), ("cookie", " cookie"),
                  ("computers", " computers"), ("songs-poems", " poems"), ("politics", " politics"),
                  ("miscellaneous", " misc"), ("work", " work"), ("science", " science"),
                  ("men-women", " relationships"), ("zippy", " nonsense"), ("knghtbrd", " chat"),
                  ("platitudes", " sayings"), ("art", " art"), ("fortunes", " fortunes"), ("wisdom", " wisdom"))
FORTUNE_PROMPT = ("Fortune: {fortune}\n", "Which topic is this fortune from? Answer:")


# Suffixes of this benchmark alone: +bf16, the model held in bf16 weights (AdamW's moments in bf16 too, as torch
# makes them); +wsr, the scheduler's chunked step writes bf16 weights by stochastic rounding (weight_rounding);
# +op, the run fails unless the held step went through slimfit::adam_blockwise_ (the default held step does
# whenever it can; `+q8all` rows at commits before 3f7ceba ran the decode / torch's Adam / encode round);
# +noemb, the input embedding (and a head tied to it) never trained: requires_grad off before the scheduler and
# the optimizer are built, so it holds no gradient and no AdamW state (what an LLM's 152k-row embedding costs).
# +untie, the LM head made a parameter of its own (a copy of the tied table) before anything else: with +noemb the
# input table alone is held, as in an untied model (Llama-3.1-8B's), the head trains.
DTYPE_SUFFIXES = ("+bf16", "+wsr", "+op", "+noemb", "+untie")


def _weights(spec: str) -> tuple[str, bool, bool]:
    """(the spec without DTYPE_SUFFIXES, bf16 weights, stochastic weight rounding)."""
    core = spec
    for suffix in DTYPE_SUFFIXES:
        core = core.replace(suffix, "")
    return core, "+bf16" in spec, "+wsr" in spec


def _method(spec: str) -> tuple[str | None, float, dict]:
    """'full' -> (None, 0, {}); 'paper@0.7+q8' -> ('paper', 0.7, {'frozen_state': 'compress'}): the accuracy
    benchmark's spec names (bench/accuracy.parse_spec), the preset None for full fine-tuning (full+bnb8 too: its
    optimizer is bench/accuracy.spec_optimizer's); +bf16 / +wsr (DTYPE_SUFFIXES) are read by run_one."""
    from bench.accuracy import BNB8, SPEC_DEFAULTS, parse_spec

    spec, _, stochastic = _weights(spec)
    name, rate, options = parse_spec(spec)
    if stochastic:
        options["weight_rounding"] = "stochastic"
    if name in ("full", BNB8):
        return None, 0.0, {}
    # what the spec does not name is bench/accuracy.py's SPEC_DEFAULTS (frozen_state=None unless +q8 / +q8all ...)
    return name, 0.7 if rate is None else rate, {**SPEC_DEFAULTS, **options}


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


def encoder(tokenizer, args):
    """The task's PromptEncoder (Rotten Tomatoes: the demo's prompt and answers)."""
    from slimfit.demo.decoder import PromptEncoder

    if args.task == "fortunes":
        return PromptEncoder(tokenizer, args.max_length, tuple(a for _, a in FORTUNE_TOPICS), FORTUNE_PROMPT)
    return PromptEncoder(tokenizer, args.max_length)


def _scored(model, enc, test, measured: dict) -> float:
    """Held-out answer loss (into `measured`) and accuracy, timed (measured["eval_s"])."""
    from slimfit.demo.decoder import evaluate_decoder

    start = time.perf_counter()
    measured["loss"] = heldout_loss(model, enc, test)
    accuracy = evaluate_decoder(model, enc, test, progress=False)
    measured["eval_s"] = time.perf_counter() - start
    return accuracy


@contextlib.contextmanager
def _fused_calls():
    """A list that gets one entry per slimfit::adam_blockwise_ call of the held step while the block runs."""
    from slimfit.optim import fused_held_step

    calls, launch = [], fused_held_step._launch

    def counted(*args, **kwargs):
        calls.append(1)
        return launch(*args, **kwargs)

    fused_held_step._launch = counted
    try:
        yield calls
    finally:
        fused_held_step._launch = launch


def run_one(base_model, tokenizer, train, test, spec: str, seed: int, args) -> dict:
    from bench.accuracy import spec_optimizer
    from slimfit.training.finetune import prepare_preset, train_and_evaluate

    start = time.perf_counter()
    enc = encoder(tokenizer, args)
    preset, rate, options = _method(spec)
    if "warmup_share" in options:   # +warmNN: the rate's ramp over NN% of the steps, as bench/accuracy.py does
        options["warmup_steps"] = round(options.pop("warmup_share") * args.steps)
    core, bf16, _ = _weights(spec)
    torch.manual_seed(seed)
    model = copy.deepcopy(base_model)
    if bf16:
        model.to(torch.bfloat16)
    if "+untie" in spec:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    if "+noemb" in spec:
        model.get_input_embeddings().weight.requires_grad_(False)
    model.train()
    prepared = prepare_preset(preset, rate, scheduler_options=options, optimizer=spec_optimizer(core))(model, seed)
    measured = {}
    with _fused_calls() as fused:
        result = train_and_evaluate(prepared, lambda idx: enc.train_batch([train[i] for i in idx]), len(train),
                                    steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=seed, device="cpu",
                                    progress=False, evaluate_fn=lambda m: _scored(m, enc, test, measured))
    if "+op" in spec and not fused:
        raise SystemExit(f"{spec!r}: the held step never went through slimfit::adam_blockwise_ (+op asks it to)")
    row = _row(spec, seed, args, (len(train), len(test)), measured["loss"], result.accuracy)
    row.update(step_ms=f"{result.step_ms:.0f}", frozen_share=f"{result.frozen_share:.3f}")
    losses = result.losses
    row.update(train_loss_first10=f"{statistics.mean(losses[:10]):.4f}",
               train_loss_last10=f"{statistics.mean(losses[-10:]):.4f}",
               train_losses=" ".join(f"{x:.4f}" for x in losses), eval_s=f"{measured['eval_s']:.0f}",
               run_s=f"{time.perf_counter() - start:.0f}")
    return row


def zero_shot(base_model, tokenizer, train, test, args) -> dict:
    """The pretrained model scored as it is (no step): the row of method `zero-shot`."""
    start = time.perf_counter()
    measured = {}
    accuracy = _scored(base_model, encoder(tokenizer, args), test, measured)
    base_model.train()
    row = _row("zero-shot", "-", args, (len(train), len(test)), measured["loss"], accuracy, trained=False)
    row.update(eval_s=f"{measured['eval_s']:.0f}", run_s=f"{time.perf_counter() - start:.0f}")
    return row


def _protocol(spec: str, seed, args, sizes: tuple, trained: bool = True) -> dict:
    """What a run is (`sizes`: train and test examples; a zero-shot row, `trained` False: 0 steps, no batch
    size or lr)."""
    return {"method": spec, "seed": str(seed), "steps": str(args.steps if trained else 0),
            "batch_size": args.batch_size if trained else "-", "lr": args.lr if trained else "-",
            "max_length": args.max_length, "n_train": sizes[0], "n_test": sizes[1]}


def _row(spec: str, seed, args, sizes: tuple, loss: float, accuracy: float, trained: bool = True) -> dict:
    """A CSV row: the protocol's cells (_protocol), the results, the provenance."""
    versions = _results.versions()
    return {**_protocol(spec, seed, args, sizes, trained),
            "heldout_loss": f"{loss:.5f}", "accuracy": f"{accuracy:.4f}", "step_ms": "", "frozen_share": "",
            "whole_share": f"{getattr(args, 'whole_share', 0):.3f}",
            "device": _results.device_name("cpu"), "torch": versions["torch"], "date": _results.now(),
            "commit": _results.commit_label()}


def _key(row: dict) -> tuple:
    """What makes two fortunes rows the same run (the Rotten Tomatoes rows: method, seed and steps)."""
    return tuple(str(row.get(k, "")) for k in ("method", "seed", "steps", "batch_size", "lr", "max_length",
                                                "n_train", "n_test"))


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


def markdown_fortunes(rows: list[dict]) -> str:
    """The fortunes protocol: the zero-shot model, then per method and settings mean ± std of held-out loss
    and accuracy with the paired differences from full fine-tuning (same settings and seeds) and the train loss
    of the first / last 10 steps; every run below."""
    answers = ", ".join(f"{t} `{a.strip()}`" for t, a in FORTUNE_TOPICS)
    lines = ["# Decoder accuracy: SmolLM2-135M-Instruct on 16 Debian fortune topics as an instruction", "",
             f"`{_results.command('decoder_accuracy', ['--task', 'fortunes'])}`; rows: decoder_fortunes_cpu.csv. "
             "Prompt `Fortune: <text>\\nWhich topic is this fortune from? Answer:`, the answer one token naming "
             f"the topic ({answers}); the loss on the answer only; accuracy: the answer with the highest "
             "log-likelihood of the 16; a balanced held-out set (the same count per topic). Each seed draws its "
             "own batches from one split; gaps are paired on the seeds both have.", ""]
    for r in (r for r in rows if r["method"] == "zero-shot"):
        lines += [f"Zero-shot (the pretrained model, no step; <= {r['max_length']} tokens, {r['n_test']} held-out): "
                  f"accuracy {100 * float(r['accuracy']):.2f}%, held-out answer loss {float(r['heldout_loss']):.4f}.",
                  ""]
    trained = [r for r in rows if r["method"] != "zero-shot"]
    groups = {}
    for r in trained:
        groups.setdefault(_key(r)[:1] + _key(r)[2:], []).append(r)
    body = [_summary_cells(mine, groups.get(("full",) + key[1:], [])) for key, mine in groups.items()]
    lines += _results.md_table(["method", "steps, batch, lr, max length", "seeds", "held-out loss", "accuracy %",
                                "loss vs full", "points vs full (per seed)", "train loss, first 10 steps",
                                "last 10 steps"], body, right=range(3, 9))
    runs = [[r["method"], r["seed"], f"{100 * float(r['accuracy']):.2f}", r["heldout_loss"],
             r["train_loss_first10"], r["train_loss_last10"], r["step_ms"], f"{float(r['run_s']) / 60:.1f}",
             r["whole_share"], r["date"]] for r in trained]
    lines += ["", "Every run (wall time: training, the memory measurements, the evaluation; 1 thread):", ""]
    lines += _results.md_table(["method", "seed", "accuracy %", "held-out loss", "train loss, first 10",
                                "last 10", "step ms", "run min", "texts whole", "date"], runs, right=range(2, 9))
    return "\n".join(lines) + "\n"


def _summary_cells(mine: list[dict], full: list[dict]) -> list:
    """One line of the fortunes summary: `mine`'s rows against full fine-tuning's `full` on shared seeds."""
    by_seed = {r["seed"]: r for r in full}
    both = [r for r in mine if r["seed"] in by_seed]
    dloss = [float(r["heldout_loss"]) / float(by_seed[r["seed"]]["heldout_loss"]) - 1 for r in both]
    dacc = [100 * (float(r["accuracy"]) - float(by_seed[r["seed"]]["accuracy"])) for r in both]
    acc = [100 * float(r["accuracy"]) for r in mine]
    r0 = mine[0]
    return [r0["method"], f"{r0['steps']}, {r0['batch_size']}, {r0['lr']}, {r0['max_length']}",
            ",".join(r["seed"] for r in mine), _mean_std([float(r["heldout_loss"]) for r in mine], ".4f"),
            f"{_mean_std(acc, '.2f')} ({', '.join(f'{a:.2f}' for a in acc)})",
            f"{100 * statistics.mean(dloss):+.2f}%" if dloss else "-",
            f"{statistics.mean(dacc):+.2f} ({', '.join(f'{d:+.2f}' for d in dacc)})" if dacc else "-",
            _mean_std([float(r["train_loss_first10"]) for r in mine], ".3f"),
            _mean_std([float(r["train_loss_last10"]) for r in mine], ".3f")]


def _assets(args):
    from slimfit.demo.assets import load_data
    from slimfit.demo.decoder import load_smollm2

    if args.task == "fortunes":
        train, test = fortune_split(args.n_train, args.n_test)
    else:
        train, test = load_data("rotten_tomatoes", 0, args.n_train, args.n_test)  # one split for every seed
    model, tokenizer = _tiny() if args.quick else load_smollm2(progress=False)
    if args.quick:
        train, test = train[:32], test[:16]
    if args.task == "fortunes":
        args.whole_share = whole_share(encoder(tokenizer, args), train + test)
    return (model, tokenizer), train, test


def fortune_split(n_train: int, n_test: int):
    """(train, test) of the 16-topic fortunes, one split for every seed (shuffled with seed 0): the test set
    balanced, the first n_test // 16 fortunes of each topic; train the first n_train of the others (the
    topics' own shares). Checks that the labels are FORTUNE_TOPICS' files (their fortunes counted)."""
    import os

    from slimfit.demo import assets

    counts = []
    for topic, _ in FORTUNE_TOPICS:
        path = os.path.join(assets.FORTUNES_DIR, topic)
        if not os.path.isfile(path):
            raise assets.MissingAsset(f"{path} is missing: " + assets.FORTUNES_HINT)
        with open(path, encoding="utf-8", errors="replace") as fh:
            counts.append(sum(0 < len(t.strip()) <= 1000 for t in fh.read().split("\n%\n")))
    data, _ = assets.fortunes(0, sum(counts), 0, classes=len(FORTUNE_TOPICS))
    found = [sum(y == label for _, y in data) for label in range(len(FORTUNE_TOPICS))]
    if found != counts:
        raise SystemExit(f"the 16 largest fortune files are not {[t for t, _ in FORTUNE_TOPICS]} (fortunes per "
                         f"label {found}, those files hold {counts}): update FORTUNE_TOPICS")
    per, seen, test, rest = n_test // len(counts), [0] * len(counts), [], []
    for text, label in data:
        (test if seen[label] < per else rest).append((text, label))
        seen[label] += 1
    if min(counts) < per + 1:
        raise ValueError(f"{n_test} test fortunes need {per} of each topic; the smallest holds {min(counts)}")
    return rest[:n_train], test


def whole_share(enc, examples) -> float:
    """Share of `examples` whose text the prompt keeps whole (not cut at the max length)."""
    return sum(len(enc._ids(text + enc.tail)) <= enc.budget for text, _ in examples) / max(len(examples), 1)


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


def _arguments(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=sorted(TASKS), default="rotten_tomatoes")
    p.add_argument("--methods")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--max-length", type=int)
    p.add_argument("--n-train", type=int)
    p.add_argument("--n-test", type=int)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--render-only", action="store_true")
    args = p.parse_args(argv)
    for key, value in TASKS[args.task].items():   # flags left unset: the task's defaults
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.quick:
        args.steps, args.batch_size = 3, 2
        if args.task == "fortunes":
            args.n_test = len(FORTUNE_TOPICS)
    return args


def _done(row: dict, done: list[dict], task: str) -> bool:
    """Whether `row`'s run is among `done` (Rotten Tomatoes: the same method, seed and steps)."""
    if task == "rotten_tomatoes":
        return any(all(r[k] == row[k] for k in ("method", "seed", "steps")) for r in done)
    return any(_key(r) == _key(row) for r in done)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    fields, fortunes = args.fields, args.task == "fortunes"
    render = markdown_fortunes if fortunes else markdown
    path = _results.results_path(args.results, "csv", "cpu")
    done = [] if args.quick else _results.read_rows(path)

    def keep(row):   # the CSV row and the Markdown as each run lands
        done.append(row)
        if not args.quick:
            _results.append_row(path, {f: row.get(f, "") for f in fields}, fields)
            _results.write_text(_results.results_path(args.results, "md", "cpu"), render(done))

    if not args.render_only:
        (model, tokenizer), train, test = _assets(args)
        shot = _protocol("zero-shot", "-", args, (len(train), len(test)), trained=False)
        if fortunes and not _done(shot, done, args.task):
            keep(zero_shot(model, tokenizer, train, test, args))
            print(f"zero-shot: loss {done[-1]['heldout_loss']} accuracy {done[-1]['accuracy']}", flush=True)
        for seed in [int(s) for s in args.seeds.split(",")]:
            for spec in args.methods.split(","):
                planned = _protocol(spec, seed, args, (len(train), len(test)))
                if _done(planned, done, args.task):
                    continue
                row = run_one(model, tokenizer, train, test, spec, seed, args)
                print(f"{spec:20s} seed {seed}: loss {row['heldout_loss']} accuracy {row['accuracy']}"
                      + (f" ({row['run_s']} s)" if fortunes else ""), flush=True)
                keep(row)
    text = render(done)
    print(text)
    if not args.quick:
        _results.write_text(_results.results_path(args.results, "md", "cpu"), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
