#!/usr/bin/env python
"""MEFT (slimfit.reversible) on the CPU: saved activation bytes against depth, the recomputation cost,
and (--fidelity) how near the converted pretrained MiniLM-L6 starts and how exactly backward
reconstructs its inputs.

    python -m bench.meft_memory              # memory + time: writes bench/results/meft_memory_cpu.{csv,md} (~2 min)
    python -m bench.meft_memory --fidelity   # MiniLM-L6: writes bench/results/meft_fidelity_cpu.{csv,md} (~1-2 min)
    python -m bench.meft_memory --quick      # tiny shapes, prints only

Memory: BertForSequenceClassification built from a BERT-base-shaped config (hidden 768, 12 heads,
FFN 3072; no weights loaded: the bytes do not depend on the values) with depth 2/4/8/12, batch 2,
seq 128, fp32, train mode (dropout on), SDPA attention. Rows:
  plain     every parameter trainable, plain PyTorch
  adapters  slimfit.reversible.add_adapters (one FFN-parallel adapter per layer, bottleneck 8), base frozen
  meftN     slimfit.reversible.convert(form="meftN"), all layers reversible, base frozen
  meftN-nr  the same network with reversible_layers=0 (plain autograd through the MEFT layers)
Saved bytes = slimfit.memory.measure (saved-tensor hooks; parameters not counted) of one forward; step peak =
the total peak of one whole training step (slimfit.step_memory: forward, backward, AdamW with lr 0 over the
trainable parameters, zero_grad; AdamW state made beforehand), both through bench/_measure.py.
Step time: forward + backward of the depth given by --time-depth, median of --repeats steps after one
warm-up, the reversible and the non-reversible run of a form alternating in the same process; the
ratio is the price of recomputing F and G in backward.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/meft_memory.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import copy
import statistics
import time

import torch

import slimfit.reversible as rv
from bench import _measure, _results

FORMS = ("meft1", "meft2", "meft3")


def bert(depth: int, hidden: int, heads: int, ffn: int, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.BertConfig(num_hidden_layers=depth, hidden_size=hidden, num_attention_heads=heads,
                        intermediate_size=ffn, num_labels=2)
    return tf.BertForSequenceClassification(cfg).train()


def batch(n: int, seq: int, vocab: int = 30522):
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(1000, vocab, (n, seq), generator=g),
            "attention_mask": torch.ones(n, seq, dtype=torch.long),
            "labels": torch.randint(0, 2, (n,), generator=g)}


def prepare(model, method: str):
    if method == "plain":
        return model
    if method == "adapters":
        return rv.add_adapters(model)[0]
    form, _, nr = method.partition("-")
    return rv.convert(model, form=form, reversible_layers=0 if nr else None)[0]


def step(model, inputs):
    model(**inputs).loss.backward()
    model.zero_grad(set_to_none=True)


def timed(model, inputs, seed: int) -> float:
    torch.manual_seed(seed)
    t = time.perf_counter()
    step(model, inputs)
    return time.perf_counter() - t


def fmt_mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def run_memory(args):
    methods = ["plain", "adapters"] + [m for f in FORMS for m in (f, f + "-nr")]
    inputs = batch(args.batch, args.seq)
    rows = []
    what = _measure.What(peak=not args.no_peak)
    for depth in args.depths:
        base = bert(depth, args.hidden, args.heads, args.ffn)
        for method in methods:
            model = prepare(copy.deepcopy(base), method)
            result = _measure.measure(_measure.Setup(model, inputs), what)
            saved = result.saved.total
            rows.append({"depth": depth, "method": method, "saved_bytes": saved, **_measure.peak_columns(result)})
            peak = "" if result.peak is None else f"  step peak {fmt_mib(result.peak.total):>8s} MiB"
            print(f"depth {depth:2d}  {method:9s} saved {fmt_mib(saved):>8s} MiB{peak}", flush=True)
            del model, result
    times = []
    base = bert(args.time_depth, args.hidden, args.heads, args.ffn)
    for form in FORMS:
        model = prepare(copy.deepcopy(base), form)
        runs = {"rev": [], "nr": []}
        for n in range(args.repeats + 1):
            for kind in ("rev", "nr"):
                rv.set_reversible_layers(model, None if kind == "rev" else 0)
                t = timed(model, inputs, seed=n)
                if n:  # the first round warms up
                    runs[kind].append(t)
        t_rev, t_nr = statistics.median(runs["rev"]), statistics.median(runs["nr"])
        times.append({"form": form, "depth": args.time_depth, "reversible_s": t_rev, "plain_autograd_s": t_nr,
                      "ratio": t_rev / t_nr})
        print(f"{form}: step {t_rev:.3f} s reversible vs {t_nr:.3f} s plain autograd = {t_rev / t_nr:.2f}x", flush=True)
    for method in ("plain", "adapters"):
        model = prepare(copy.deepcopy(base), method)
        ts = [timed(model, inputs, seed=n) for n in range(args.repeats + 1)][1:]
        times.append({"form": method, "depth": args.time_depth, "reversible_s": "",
                      "plain_autograd_s": statistics.median(ts), "ratio": ""})
        print(f"{method}: step {statistics.median(ts):.3f} s", flush=True)
    return rows, times


MEMORY_FIELDS = ["kind", "depth", "method", "saved_bytes", "reversible_s", "plain_autograd_s", "ratio",
                 *_measure.PEAK_COLUMNS]


def write_memory(args, rows, times):
    none = [""] * len(_measure.PEAK_COLUMNS)
    _results.write_rows(_results.results_path("meft_memory", "csv", "cpu"),
                        [["memory", r["depth"], r["method"], r["saved_bytes"], "", "", "",
                          *(r[k] for k in _measure.PEAK_COLUMNS)] for r in rows]
                        + [["time", t["depth"], t["form"], "", t["reversible_s"], t["plain_autograd_s"], t["ratio"],
                            *none] for t in times], MEMORY_FIELDS)
    _results.write_text(_results.results_path("meft_memory", "md", "cpu"), memory_markdown(args, rows, times))


def memory_markdown(args, rows, times) -> str:
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["depth"], r["method"]): r["saved_bytes"] for r in rows}
    lines = [
        "# MEFT: saved activation bytes against depth (CPU)",
        "",
        f"BertForSequenceClassification, hidden {args.hidden}, {args.heads} heads, FFN {args.ffn}, batch {args.batch}, "
        f"seq {args.seq}, fp32, train mode, SDPA; bytes saved for backward in one forward (slimfit.memory), MiB. "
        "`-nr` = the same MEFT network with plain autograd (reversible_layers=0). Command: "
        f"`{_results.command('meft_memory', [])}`.",
        "",
    ]
    d0, d1 = args.depths[0], args.depths[-1]
    body = [[m, *(fmt_mib(by[(d, m)]) for d in args.depths), fmt_mib((by[(d1, m)] - by[(d0, m)]) / (d1 - d0))]
            for m in methods]
    lines += _results.md_table(["method", *(f"depth {d}" for d in args.depths), "per extra layer"], body,
                               right=range(1, len(args.depths) + 2))
    lines += ["", f"Reduction at depth {d1} vs plain fine-tuning: " + ", ".join(
        f"{m} {by[(d1, 'plain')] / by[(d1, m)]:.1f}x" for m in methods if m != "plain")]
    lines += peak_markdown(args, rows, methods)
    lines += ["", f"## Step time (forward + backward), depth {args.time_depth}, median of {args.repeats} steps", ""]
    body = [[t["form"], f"{t['reversible_s']:.3f}" if t["reversible_s"] != "" else "-", f"{t['plain_autograd_s']:.3f}",
             f"{t['ratio']:.2f}x" if t["ratio"] != "" else "-"] for t in times]
    lines += _results.md_table(["method", "reversible s", "plain autograd s", "reversible / plain"], body,
                               right=(1, 2, 3))
    lines += ["", f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), shared 2-core machine: times are "
              "indicative, ratios within one run are the comparable numbers."]
    return "\n".join(lines) + "\n"


def peak_markdown(args, rows, methods) -> list[str]:
    """The total step peak by depth (none when not measured)."""
    peak = {(r["depth"], r["method"]): r["step_peak_bytes"] for r in rows}
    if any(v == "" for v in peak.values()):
        return []
    d1 = args.depths[-1]
    body = [[m, *(fmt_mib(peak[(d, m)]) for d in args.depths), f"{peak[(d1, 'plain')] / peak[(d1, m)]:.2f}x"]
            for m in methods]
    return ["", "## Total step peak, MiB (forward, backward, AdamW with lr 0 over the trainable parameters, "
            "zero_grad; AdamW state resident; slimfit.step_memory)", ""] + _results.md_table(
        ["method", *(f"depth {d}" for d in args.depths), f"plain / method at depth {d1}"], body,
        right=range(1, len(args.depths) + 2))


# ---- fidelity: pretrained MiniLM-L6 -------------------------------------------------------------

def _rel_rows(a, b, mask):
    """per-token ‖a − b‖/‖b‖ over non-padding tokens: (max, mean)."""
    r = ((a - b).double().norm(dim=-1) / b.double().norm(dim=-1))[mask.bool()]
    return r.max().item(), r.mean().item()


def run_fidelity(args):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from slimfit.demo.assets import minilm_dir, rotten_tomatoes

    path = minilm_dir()
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2).eval()
    train, _ = rotten_tomatoes(0, 64, 10)
    texts = train[:args.fid_batch]
    inputs = tok([t for t, _ in texts], padding=True, truncation=True, max_length=64, return_tensors="pt")
    labels = torch.tensor([y for _, y in texts])
    with torch.no_grad():
        ref = base(**inputs, output_hidden_states=True)
    h_ref, logit_ref = ref.hidden_states[-1], ref.logits
    dist, recon = [], []
    variants = [("adapters", "-")] + [(f, o) for f in FORMS for o in ("mean", "last")]
    for form, output in variants:
        model = copy.deepcopy(base)
        torch.manual_seed(1)
        if form == "adapters":
            rv.add_adapters(model)
        else:
            rv.convert(model, form=form, output=output)
        with torch.no_grad():
            h = model.bert(**inputs).last_hidden_state
            logits = model(**inputs).logits
        hmax, hmean = _rel_rows(h, h_ref, inputs["attention_mask"])
        lrel = ((logits - logit_ref).norm() / logit_ref.norm()).item()
        cos = torch.nn.functional.cosine_similarity(h[:, 0], h_ref[:, 0], dim=-1).mean().item()
        dist.append({"form": form, "output": output, "hidden_rel_max": hmax, "hidden_rel_mean": hmean,
                     "cls_cosine": cos, "logits_rel": lrel})
        print(f"init distance {form:8s} {output:4s}: hidden rel max {hmax:.3f} mean {hmean:.3f}, "
              f"[CLS] cosine {cos:.3f}, logits rel {lrel:.3f}", flush=True)
        if form == "adapters" or output != "mean":
            continue
        for dtype in (torch.float32, torch.bfloat16):
            for stream in (None, torch.float64):
                m = copy.deepcopy(base)
                torch.manual_seed(1)  # the same adapters as the row above
                rv.convert(m, form=form, stream_dtype=stream)
                m.to(dtype).train()
                with rv.record_states(m) as rec:
                    torch.manual_seed(3)
                    m(**inputs, labels=labels).loss.backward()
                errs = [max(((b.double() - f.double()).norm() / f.double().norm()).item()
                            for b, f in zip(rec.backward[i], rec.forward[i])) for i in sorted(rec.backward)]
                recon.append({"form": form, "dtype": str(dtype).replace("torch.", ""),
                              "stream": "fp64" if stream is not None else "model", "errors": errs})
                print(f"  reconstruction {form} {dtype} stream {stream}: " + " ".join(f"{e:.1e}" for e in errs),
                      flush=True)
    return dist, recon


def write_fidelity(dist, recon, n_texts):
    rows = [["init", d["form"], d["output"], "", f"hidden_rel_max={d['hidden_rel_max']:.4g};"
             f"hidden_rel_mean={d['hidden_rel_mean']:.4g};cls_cosine={d['cls_cosine']:.4g};"
             f"logits_rel={d['logits_rel']:.4g}"] for d in dist]
    rows += [["reconstruction", r["form"], r["dtype"], r["stream"], ";".join(f"{e:.3g}" for e in r["errors"])]
             for r in recon]
    _results.write_rows(_results.results_path("meft_fidelity", "csv", "cpu"), rows,
                        ["kind", "form", "output_or_dtype", "stream", "values"])
    _results.write_text(_results.results_path("meft_fidelity", "md", "cpu"), fidelity_markdown(dist, recon, n_texts))


def fidelity_markdown(dist, recon, n_texts) -> str:
    lines = ["# MEFT on the pretrained all-MiniLM-L6-v2 (6 layers, hidden 384): distance at init, reconstruction",
             "", f"{n_texts} Rotten Tomatoes sentences, max length 64, classifier head randomly initialised (seed 0) "
             "and shared by every row; adapters bottleneck 8, N(0, 0.02). Command: "
             f"`{_results.command('meft_memory', ['--fidelity'])}`.",
             "", "## Distance to the unconverted model at init (eval mode)", "",
             "Per-token ‖h − h_ref‖/‖h_ref‖ of the final hidden states (max, mean over non-padding tokens), cosine of "
             "the [CLS] vectors, and ‖logits − logits_ref‖/‖logits_ref‖.", ""]
    body = [[d["form"], d["output"], *(f"{d[k]:.3f}" for k in ("hidden_rel_max", "hidden_rel_mean", "cls_cosine",
                                                                "logits_rel"))] for d in dist]
    lines += _results.md_table(["variant", "output", "hidden rel max", "hidden rel mean", "[CLS] cosine",
                                "logits rel"], body, right=(2, 3, 4, 5))
    layers = len(recon[0]["errors"])
    lines += ["", "## Reconstruction error of the reversible backward (train mode, dropout on)", "",
              "Per layer, bottom (layer 0) to top: max over the pair of ‖x_reconstructed − x_forward‖/‖x_forward‖.", ""]
    body = [[r["form"], r["dtype"], r["stream"], *(f"{e:.1e}" for e in r["errors"])] for r in recon]
    lines += _results.md_table(["form", "model dtype", "stream", *(f"layer {i}" for i in range(layers))], body,
                               right=range(3, 3 + layers))
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, prints only")
    p.add_argument("--fidelity", action="store_true", help="MiniLM-L6 distance at init and reconstruction error")
    p.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8, 12])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--time-depth", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fid-batch", type=int, default=8)
    p.add_argument("--no-peak", action="store_true", help="saved bytes only, no total step peak")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.hidden, args.heads, args.ffn = (768, 12, 3072)
    if args.quick:
        args.hidden, args.heads, args.ffn, args.depths = 64, 4, 128, [1, 2]
        args.seq, args.time_depth, args.repeats = 16, 1, 1
    if args.fidelity:
        dist, recon = run_fidelity(args)
        if not args.quick:
            write_fidelity(dist, recon, args.fid_batch)
        return
    rows, times = run_memory(args)
    if not args.quick:
        write_memory(args, rows, times)


if __name__ == "__main__":
    main()
