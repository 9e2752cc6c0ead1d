"""Variance of the sampled weight gradient (WTA-CRS vs plain CRS vs exact) on real fine-tuning data,
and the activation bytes it saves.

    python -m bench.wta_crs_variance [--batch 32] [--max-length 64] [--ratio 0.3] [--gap-steps 5]
                                      [--seeds 100] [--layers 1,4] [--csv PATH]

Data: the pretrained all-MiniLM-L6-v2 (a 6-layer BERT, hidden 384, FFN 1536) with a fresh
2-class head on Rotten Tomatoes snippets, the offline assets of `slimfit demo` (see
slimfit/demo/assets.py), built by bench/_measure.py. Without them a randomly initialised model of the
same shape (bench/_measure.build) on random token ids padded to random lengths is used, and the header
says so (its gradients are not realistic).

Protocol (the paper's setting, arXiv 2305.15265):
1. visit 1: forward/backward of batch A; the output-gradient row norms ‖gᵢ‖ of every target
   linear are recorded (what a NormCache would hold);
2. `--gap-steps` AdamW steps (lr 2e-5) on other batches, so the weights move as between two
   epochs;
3. visit 2: batch A again; the inputs x and output gradients g of the target linears are captured
   and dW = gᵀx is the exact gradient.
For each target linear (the paper's: attention output projection, FFN up and FFN down; the
query projection as a non-target reference) and each choice of probabilities,
  uniform   pᵢ = 1/N
  x-only    pᵢ ∝ ‖xᵢ‖               (no sample ids)
  x-only-nopad  pᵢ ∝ ‖xᵢ‖, 0 on padding rows (their gradient is exactly 0 in a BERT classifier;
            what an attention-mask-aware fallback without ids would give: not in the library)
  stale     pᵢ ∝ ‖xᵢ‖·‖gᵢ‖(visit 1)  (sample ids + NormCache: what the library does)
  oracle    pᵢ ∝ ‖xᵢ‖·‖gᵢ‖(visit 2)  (unattainable: g is unknown in forward)
it prints the relative variance E‖dŴ − dW‖²/‖dW‖² of CRS and WTA-CRS at the same k = ⌈ratio·N⌉
(exact formula, `wta_crs.expected_sq_error`; exact dW has 0), the measured value over `--seeds`
draws for the stale row (the sampler and estimator `sampled_linear`'s backward uses; the tests
check the Function itself against the same formula), |C| and the WTA/CRS ratio.
Bytes: what one target linear saves for backward (slimfit.memory through bench/_measure.py: full input
vs kept rows + indices + scales, fp32 and 8-bit kept rows), and the whole model's saved bytes with the three
target linears of every layer sampled (forward swapped in this script only; the library's
patch does not do it yet).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/wta_crs_variance.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import re
import time

import torch

from bench import _measure, _results
from slimfit.autograd import wta_crs as W
from slimfit.autograd.sampled_linear import sampled_linear

TARGETS = {  # BERT module suffix -> label
    "attention.output.dense": "attn-out",
    "intermediate.dense": "ffn-up",
    "output.dense": "ffn-down",
    "attention.self.query": "query*",
}
SAMPLED = ("attention.output.dense", "intermediate.dense", "output.dense")


def _load(batch: int, max_length: int, seed: int):
    torch.manual_seed(seed)
    try:
        from slimfit.demo.assets import MissingAsset, minilm_dir, rotten_tomatoes
    except ImportError:  # pragma: no cover
        MissingAsset = RuntimeError
        minilm_dir = rotten_tomatoes = None
    try:
        if minilm_dir is None:
            raise MissingAsset("slimfit.demo.assets is not importable")
        minilm_dir()  # MissingAsset now, before any data is read, when the offline copy is absent
        train, _ = rotten_tomatoes(seed=seed, n_train=batch * 40, n_test=10)
        tok = _measure.minilm_tokenizer()
        model = _measure.minilm(num_labels=2)
        batches = [_measure.text_batch(tok, train[i:i + batch], max_length) for i in range(0, len(train), batch)]
        return model, batches, "all-MiniLM-L6-v2 (pretrained) on Rotten Tomatoes snippets"
    except (MissingAsset, OSError, ValueError) as exc:  # offline assets missing
        model, batches = _random_minilm(batch, max_length, seed)
        return model, batches, f"RANDOM BERT (offline assets missing: {exc}); gradients not realistic"


def _random_minilm(batch: int, max_length: int, seed: int):
    """A random BERT of MiniLM-L6's shape and 40 random batches, each row padded to a random length (the
    padding rows are what the x-only-nopad row leaves out)."""
    arch, model = _measure.build("bert-base", layers=6, seed=seed, hidden_size=384, num_attention_heads=12,
                                 intermediate_size=1536)
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(40):
        inputs = _measure.inputs(model, arch, batch, max_length, seed=seed + i)
        lens = torch.randint(max_length // 4, max_length + 1, (batch,), generator=gen)
        mask = (torch.arange(max_length)[None] < lens[:, None]).long()
        batches.append({**inputs, "input_ids": inputs["input_ids"] * mask, "attention_mask": mask})
    return model, batches


def _targets(model, layers):
    """{(layer index, label): module} for the TARGETS of the chosen encoder layers."""
    out = {}
    for name, mod in model.named_modules():
        m = re.search(r"\.layer\.(\d+)\.(.+)$", name)
        if m and int(m.group(1)) in layers and m.group(2) in TARGETS:
            out[(int(m.group(1)), TARGETS[m.group(2)])] = mod
    return out


def _capture(model, batch, mods):
    """x (N × in) and g (N × out) of each module for one forward/backward of `batch`."""
    got, handles = {}, []
    for key, mod in mods.items():
        def hook(_m, args, out, key=key):
            got[key] = {"x": args[0].detach().reshape(-1, args[0].shape[-1])}
            out.register_hook(lambda g, key=key: got[key].__setitem__("g", g.detach().reshape(-1, g.shape[-1])))
        handles.append(mod.register_forward_hook(hook))
    try:
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
    finally:
        for h in handles:
            h.remove()
    return got


def _measured(x, g, p, k, seeds):
    """Mean ‖dŴ − dW‖²/‖dW‖² over `seeds` draws of the samplers `sampled_linear` uses (the same
    sample_rows / scales / Σ scale·gᵀx as its backward, without the forward GEMM)."""
    exact = g.t().double() @ x.double()
    out = {}
    for sampler in ("wta_crs", "crs"):
        tot = 0.0
        for s in range(seeds):
            rows = W.sample_rows(p, k, sampler, torch.Generator().manual_seed(s))
            tot += float((W.estimate_weight_grad(x, g, rows).double() - exact).pow(2).sum())
        out[sampler] = tot / seeds / float(exact.pow(2).sum())
    return out


def _fmt_bytes(n):
    return f"{n / 2**20:.2f} MiB"


def _step_saved(model, batch) -> int:
    """Saved bytes of the model's forward + backward on `batch` (bench/_measure.py's count for a row)."""
    return _measure.measure(_measure.Setup(model, batch), _measure.What(saved=True, peak=False)).saved.total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("--gap-steps", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--layers", default="1,4")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    layers = [int(v) for v in args.layers.split(",")]
    t0 = time.time()
    model, batches, what = _load(args.batch, args.max_length, args.seed)
    model.train()
    for m in model.modules():  # dropout off: the two visits differ by the weights only
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    mods = _targets(model, layers)
    batch_a = batches[0]
    n_pad = int((batch_a["attention_mask"] == 0).sum())
    pad_free = batch_a["attention_mask"].reshape(-1).bool()
    n_rows = batch_a["attention_mask"].numel()

    first = _capture(model, batch_a, mods)
    stale = {key: v["g"].norm(dim=1) for key, v in first.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    for b in batches[1:1 + args.gap_steps]:
        opt.zero_grad(set_to_none=True)
        model(**b).loss.backward()
        opt.step()
    second = _capture(model, batch_a, mods)

    print(f"# WTA-CRS variance: {what}")
    print(f"# batch {args.batch} x {batch_a['input_ids'].shape[1]} tokens = N {n_rows} rows ({n_pad} padding), "
          f"ratio {args.ratio}, stale norms from {args.gap_steps} AdamW steps earlier, torch {torch.__version__}")
    print("# relative variance E||dW_hat - dW||^2 / ||dW||^2 (exact formula); exact dW: 0")
    header = ["layer", "linear", "N", "k", "probs", "|C|", "CRS", "WTA-CRS", "WTA/CRS", "measured CRS", "measured WTA"]
    rows = []
    for (li, label), v in sorted(second.items()):
        x, g = v["x"].float(), v["g"].float()
        n = x.shape[0]
        k = W.num_kept_rows(n, args.ratio, 10)
        exact_sq = float((g.t().double() @ x.double()).pow(2).sum())
        pad_g = float(g.norm(dim=1)[~pad_free].max()) if bool((~pad_free).any()) else 0.0
        if pad_g > 0:
            print(f"# note: layer {li} {label}: padding rows have gradient norm up to {pad_g:.2e}")
        probs = {
            "uniform": torch.full((n,), 1.0 / n),
            "x-only": W.sampling_probabilities(x.norm(dim=1)),
            "x-only-nopad": W.sampling_probabilities(x.norm(dim=1) * pad_free),
            "stale": W.sampling_probabilities(x.norm(dim=1), stale[(li, label)]),
            "oracle": W.sampling_probabilities(x.norm(dim=1), g.norm(dim=1)),
        }
        for pname, p in probs.items():
            crs = W.expected_sq_error(x, g, p, k, "crs") / exact_sq
            wta = W.expected_sq_error(x, g, p, k, "wta_crs") / exact_sq
            c = W.deterministic_count(p, k)
            meas = ("", "")
            if pname == "stale" and args.seeds > 0:
                m = _measured(x, g, p, k, args.seeds)
                meas = (f"{m['crs']:.4f}", f"{m['wta_crs']:.4f}")
            rows.append([li, label, n, k, pname, c, f"{crs:.4f}", f"{wta:.4f}", f"{wta / crs:.3f}", *meas])
    print("\n".join(_results.text_table(header, rows, right=range(len(header)))))
    print("# query* is not a target (the paper leaves Q/K/V exact); shown for reference")

    # ---------------------------------------------------------------- bytes
    print("\n# bytes saved for backward (slimfit.memory), one forward of the same batch")
    (li, label) = sorted(k for k in second if k[1] == "ffn-up")[0]
    mod = mods[(li, label)]
    xin = second[(li, label)]["x"].reshape(batch_a["input_ids"].shape[0], -1, mod.in_features).clone()
    n = xin.shape[0] * xin.shape[1]
    k = W.num_kept_rows(n, args.ratio, 10)
    full = _measure.saved_of(lambda x: torch.nn.functional.linear(x, mod.weight, mod.bias), xin,
                             backward=False).total
    samp = _measure.saved_of(lambda x: sampled_linear(x, mod.weight, mod.bias, ratio=args.ratio), xin,
                             backward=False).total
    samp8 = _measure.saved_of(lambda x: sampled_linear(x, mod.weight, mod.bias, ratio=args.ratio, input_bits=8),
                              xin, backward=False).total
    print(f"layer {li} {label} ({mod.in_features} -> {mod.out_features}), N {n}, k {k}:")
    print(f"  full linear          {full:>10d} B  (N*in*4)")
    print(f"  sampled fp32 rows    {samp:>10d} B  (k*in*4 + 4k idx + 4k scales = {k * mod.in_features * 4 + 8 * k})"
          f"  {full / samp:.2f}x less")
    print(f"  sampled 8-bit rows   {samp8:>10d} B  {full / samp8:.2f}x less")

    saved_forwards = {}
    baseline = _step_saved(model, batch_a)
    for name, m in model.named_modules():
        hit = re.search(r"\.layer\.\d+\.(.+)$", name)
        if isinstance(m, torch.nn.Linear) and hit and hit.group(1) in SAMPLED:
            def fwd(x, m=m):
                return sampled_linear(x, m.weight, m.bias, ratio=args.ratio)
            saved_forwards[name] = m
            m.forward = fwd
    patched = _step_saved(model, batch_a)
    for m in saved_forwards.values():
        del m.forward
    print(f"whole model, every weight trainable: plain {_fmt_bytes(baseline)}, with attn-out/ffn-up/ffn-down sampled "
          f"at ratio {args.ratio}: {_fmt_bytes(patched)} ({baseline / patched:.2f}x less; "
          f"{len(saved_forwards)} linears)")
    print(f"# {time.time() - t0:.0f} s")
    if args.csv:
        _results.write_rows(args.csv, rows, header)


if __name__ == "__main__":
    main()
