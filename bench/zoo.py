#!/usr/bin/env python
"""Every architecture of the zoo at its real width: what slimfit's paper() keeps for backward against plain
PyTorch (SDPA) with the same frozen set, and what stops it where it keeps more.

    python -m bench.zoo                     # every architecture, batch 1, seq 1024 (vision: its image size),
                                            # 2 layers at the default config's width; appends to
                                            # bench/results/zoo_cpu.csv (resumable), rewrites zoo_cpu.md
    python -m bench.zoo --only qwen3,gemma3 --peak   # also the total step peak (slower)
    python -m bench.zoo --quick             # 3 architectures, seq 64, narrow: writes nothing

Each model is the transformers default config of its class (the family's published width, heads, vocab)
with 2 layers (saved bytes per layer do not depend on depth; 2 layers show the per-layer pattern and keep
the models within this machine), random weights, train mode. The frozen set is ILSScheduler's first one at
its default rate (0.7). Columns: plain sdpa (all trainable), plain with the frozen set, paper() with it,
the ratio of the last two (the target: 4x), and the modules that keep the most under paper() with their
share, so a row below target names what stops it. The first frozen set of a 2-layer model is a few layers,
so whether the largest ones (a mixture's experts) are in it moves that ratio; the rate's average does not:
each side measured with every scheduled layer trained and with every one frozen, mixed at the rate
((1 - 0.7) trained + 0.7 frozen, each layer frozen that share of the steps). `--peak` adds the total
step peak of paper() and plain (AdamW over every parameter for paper(), as under the scheduler).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/zoo.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import os
import sys
import warnings

import torch

from bench import _measure, _results
from slimfit import architectures as archs

MiB = 2 ** 20
TARGET = 4.0
# name -> (config class, model class, task, extra config fields)
ZOO = {
    "bert": ("BertConfig", "BertForSequenceClassification", archs.TEXT_CLS, {}),
    "roberta": ("RobertaConfig", "RobertaForSequenceClassification", archs.TEXT_CLS, {}),
    "electra": ("ElectraConfig", "ElectraForSequenceClassification", archs.TEXT_CLS, {}),
    "deberta-v2": ("DebertaV2Config", "DebertaV2ForSequenceClassification", archs.TEXT_CLS, {}),
    "modernbert": ("ModernBertConfig", "ModernBertForSequenceClassification", archs.TEXT_CLS, {}),
    "vit": ("ViTConfig", "ViTForImageClassification", archs.IMAGE_CLS, {}),
    "dinov2": ("Dinov2Config", "Dinov2ForImageClassification", archs.IMAGE_CLS, {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", archs.CAUSAL_LM, {"n_layer": 2}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", archs.CAUSAL_LM, {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", archs.CAUSAL_LM, {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", archs.CAUSAL_LM, {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", archs.CAUSAL_LM, {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", archs.CAUSAL_LM, {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", archs.CAUSAL_LM, {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", archs.CAUSAL_LM, {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", archs.CAUSAL_LM, {}),
    "phi": ("PhiConfig", "PhiForCausalLM", archs.CAUSAL_LM, {}),
    "falcon": ("FalconConfig", "FalconForCausalLM", archs.CAUSAL_LM, {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", archs.CAUSAL_LM, {}),
    "opt": ("OPTConfig", "OPTForCausalLM", archs.CAUSAL_LM, {}),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", archs.CAUSAL_LM, {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", archs.CAUSAL_LM, {}),
    # MoE at real width with fewer experts (the default configs hold 2.8B / 2.4B parameters in 2 layers, too
    # many for a 24 GiB machine with AdamW; the saved bytes per routed token do not depend on the count)
    # one layer of the real 8 experts (top-2 routing as published) rather than two layers of 2 experts, where
    # every token reaches every expert and transformers' experts forward differs from the per-expert loop by
    # 1e-5 at this width (the probe leaves them alone, as it should): both fit this machine
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", archs.CAUSAL_LM, {"num_hidden_layers": 1}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", archs.CAUSAL_LM, {"num_experts": 16}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", archs.CAUSAL_LM, {}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", archs.CAUSAL_LM, {}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", archs.CAUSAL_LM, {"n_layer": 2}),
    # Cohere's 256k x 8192 embedding alone is 8 GiB in fp32: a 32k vocabulary, the layers as published (two of
    # them still take about 18 GB here: it runs on a 24 GiB machine only with nothing else running)
    "cohere": ("CohereConfig", "CohereForCausalLM", archs.CAUSAL_LM, {"vocab_size": 32000}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", archs.CAUSAL_LM, {}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", archs.CAUSAL_LM, {}),
    "bloom": ("BloomConfig", "BloomForCausalLM", archs.CAUSAL_LM, {"n_layer": 2}),
}
QUICK = ("bert", "qwen3", "mixtral")
NARROW = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=512, moe_intermediate_size=64, num_local_experts=4, num_experts=8)
RATE = 0.7
FIELDS = ["model", "seq", "plain_mib", "frozen_plain_mib", "paper_mib", "ratio_vs_frozen", "ratio_rate_average",
          "top_modules",
          "not_reached", "plain_peak_mib", "paper_peak_mib", "status", "torch", "date", "commit"]


def build(name: str, narrow: bool):
    """(model, task): the default config of the family with 2 layers (narrow: tiny width, --quick)."""
    import transformers as tf

    config_name, model_name, task, extra = ZOO[name]
    config = getattr(tf, config_name)()
    fields = {"num_hidden_layers": 2, **extra, **(NARROW if narrow else {})}
    for key, value in fields.items():
        if hasattr(config, key) or key in extra:
            try:
                setattr(config, key, value)
            except AttributeError:  # a derived, read-only field (Falcon's head_dim)
                pass
    if task == archs.TEXT_CLS:
        config.num_labels = 2
    torch.manual_seed(0)
    model = getattr(tf, model_name)(config)
    model.train()
    return model, task


def _inputs(model, task: str, seq: int) -> dict:
    size = getattr(model.config, "image_size", None)
    return archs.make_inputs(model, task, 1, seq, size if isinstance(size, int) else None, seed=0)


def _top(run, total: int, n: int = 3) -> str:
    collapsed = archs.collapse_layers(run)
    items = sorted(collapsed.per_module.items(), key=lambda kv: -kv[1])[:n]
    return "; ".join(f"{path} {nbytes / total:.0%}" for path, nbytes in items if nbytes)


def measure_row(name: str, args) -> dict:
    import slimfit
    from slimfit.config import SlimFitConfig

    versions = _results.versions()
    row = {"model": name, "seq": args.seq, "status": "ok", "torch": versions["torch"], "date": _results.now(),
           "commit": _results.commit_label()}
    model, task = build(name, args.quick)
    seq = min(args.seq, archs.max_tokens(model) or args.seq)  # encoders: their position table (512)
    row["seq"] = seq
    batch = _inputs(model, task, seq)
    what = _measure.What(saved=True, peak=args.peak)
    plain = _measure.measure(_measure.Setup(model, batch), what)
    saved_only = _measure.What(saved=True, peak=False)
    frozen, scheduled = archs.scheduler_frozen_set(model, RATE)
    archs.set_frozen(model, frozen)
    frozen_plain = _measure.measure(_measure.Setup(model, batch), saved_only)
    archs.set_frozen(model, scheduled)
    all_frozen_plain = _measure.measure(_measure.Setup(model, batch), saved_only).saved.total
    archs.set_frozen(model, frozen)   # patched with the first frozen set in force, as every row before
    slimfit.patch(model, SlimFitConfig.paper())
    archs.set_frozen(model, frozen)
    paper = _measure.measure(_measure.Setup(model, batch, scheduled=True), what)
    archs.set_frozen(model, scheduled)
    all_frozen_paper = _measure.measure(_measure.Setup(model, batch, scheduled=True), saved_only).saved.total
    archs.set_frozen(model, ())
    all_trained_paper = _measure.measure(_measure.Setup(model, batch, scheduled=True), saved_only).saved.total
    archs.set_frozen(model, frozen)
    average = (((1 - RATE) * plain.saved.total + RATE * all_frozen_plain)
               / ((1 - RATE) * all_trained_paper + RATE * all_frozen_paper))
    model(**batch).loss.backward()  # a training forward more, so the summary has counted attention calls
    calls = model.slimfit_summary.attention_calls()
    kept = paper.saved.total
    row.update(plain_mib=round(plain.mib("saved"), 2), frozen_plain_mib=round(frozen_plain.mib("saved"), 2),
               paper_mib=round(paper.mib("saved"), 2), ratio_vs_frozen=round(frozen_plain.saved.total / kept, 2),
               ratio_rate_average=round(average, 2),
               top_modules=_top(paper.saved, kept),
               not_reached="; ".join(f"{module}: {why}" for module, why in calls["not_reached"]))
    if args.peak:
        row.update(plain_peak_mib=round(plain.mib("peak"), 1), paper_peak_mib=round(paper.mib("peak"), 1))
    return row


def markdown(rows: list[dict], header: str) -> str:
    body = []
    for r in rows:
        ratio, average = r.get("ratio_vs_frozen") or "", r.get("ratio_rate_average") or ""
        mark = "" if not ratio or float(ratio) >= TARGET else " (below 4x)"
        mark_avg = "" if not average or float(average) >= TARGET else " (below 4x)"
        body.append([r["model"], r.get("plain_mib", "-"), r.get("frozen_plain_mib", "-"), r.get("paper_mib", "-"),
                     f"{ratio}x{mark}" if ratio else "-", f"{average}x{mark_avg}" if average else "-",
                     r.get("plain_peak_mib") or "-",
                     r.get("paper_peak_mib") or "-", r.get("top_modules", ""), r.get("not_reached", "") or "-",
                     r.get("status", "")])
    table = _results.md_table(["model", "plain MiB", "plain, frozen set MiB", "paper() MiB", "less than frozen plain",
                               "at the rate's average", "plain step peak MiB", "paper() step peak MiB",
                               "most kept under paper() (share)", "attention not reaching slimfit", "status"],
                              body, right=range(1, 8))
    return "\n".join([header, ""] + table) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help="comma-separated names of the zoo")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--peak", action="store_true", help="also the total step peak of plain and paper()")
    p.add_argument("--quick", action="store_true", help="3 narrow architectures, seq 64; writes nothing")
    p.add_argument("--render-only", action="store_true", help="the Markdown again from the CSV")
    p.add_argument("--force", action="store_true", help="measure the --only architectures again (a new row)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    names = list(QUICK) if args.quick else [n.strip() for n in (args.only or ",".join(ZOO)).split(",") if n.strip()]
    if args.quick:
        args.seq = 64
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        raise SystemExit(f"unknown architecture(s) {unknown}; the zoo: {', '.join(ZOO)}")
    csv_path = _results.results_path("zoo", "csv", "cpu", args.out)
    done = [] if args.quick or not os.path.exists(csv_path) else _results.read_rows(csv_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in [] if args.render_only else names:
            if not args.force and any(r["model"] == name and r.get("status") == "ok" for r in done):
                continue
            try:
                row = measure_row(name, args)
            except Exception as exc:  # noqa: BLE001 - an architecture that does not build or run here: said
                row = {"model": name, "seq": args.seq, "status": f"{type(exc).__name__}: {str(exc)[:160]}"}
            print(f"{name:12s} {row.get('ratio_vs_frozen', '-')!s:>6}x  {row.get('top_modules', '')}  "
                  f"{row['status']}", flush=True)
            done.append(row)
            if not args.quick:
                _results.append_row(csv_path, row, FIELDS)
    header = (f"# The zoo: paper() against plain SDPA with the same frozen set ({_results.device_name('cpu')})\n\n"
              f"`{_results.command('zoo', [])}`: each family's default transformers config with 2 layers, batch 1, "
              f"seq {args.seq} (encoders: at most their position table); saved bytes for backward of one step "
              "(slimfit.memory). Target: 4x less than plain with the same frozen set, or the modules that stop it "
              "named.")
    latest = {r["model"]: r for r in done}  # an architecture's last row (a failed one measured again later)
    text = markdown([latest[n] for n in ZOO if n in latest], header)
    print(text)
    if not args.quick:
        _results.write_text(_results.results_path("zoo", "md", "cpu", args.out), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
