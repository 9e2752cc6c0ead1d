"""Cost of ILSScheduler.step() relative to a BERT-base training step.

    python -m bench.scheduler_overhead                 # CPU (or --device cuda)
    python -m bench.scheduler_overhead --batch 8 --steps 5

Model: BertModel built from BertConfig() (12 layers, hidden 768, 12 heads, FFN 3072; random
weights, no download; bench/_measure.py's build and random batch), sequence 128,
AdamW(weight_decay=0.01), fp32, loss = mean square of the last hidden states and the pooler
output. One iteration = forward + backward + optimizer.step() + zero_grad(); then
scheduler.step() is timed on its own. Both medians are taken over the same interleaved
iterations (bench/_measure.time_interleaved: the scheduler's frozen set also makes the training
step cheaper, so the ratio is taken per configuration).
``sched_isolated_ms`` is the median of many back-to-back scheduler.step() calls without
training in between (weights do not change, scores tie at 0 and ties go to the first layers,
the 23M-entry word embedding among them: a pessimistic figure).

Target on a GPU: scheduler.step() <= 2% of a training step. Prints a table and writes
bench/results/scheduler_overhead_<cpu|gpu>.csv (device name and versions in every row).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/scheduler_overhead.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import dataclasses

import torch

from bench import _measure
from bench._results import device_name, now, results_path, versions, write_rows
from bench._timing import Settings, bench
from slimfit import architectures as archs
from slimfit.scheduler import ILSScheduler

# BERT-base's encoder without a task head: the model whose training step the scheduler's step is set against
BERT_ENCODER = dataclasses.replace(archs.ARCHITECTURES["bert-base"], name="bert-encoder", model_class="BertModel")


def build(device, args):
    """(model, batch): the encoder at args.layers / args.hidden (heads of 64, FFN 4x), train mode, and a
    random batch of token ids (BertModel takes no labels)."""
    arch, model = _measure.build(BERT_ENCODER, layers=args.layers, device=device, hidden_size=args.hidden,
                                 num_attention_heads=max(1, args.hidden // 64), intermediate_size=4 * args.hidden)
    batch = _measure.inputs(model, arch, args.batch, args.seq, device=device)
    del batch["labels"]
    return model, batch


def hidden_states_loss(out):
    """A loss over everything the encoder outputs, so that every layer gets a gradient."""
    return out.last_hidden_state.float().pow(2).mean() + out.pooler_output.float().pow(2).mean()


def run_config(device, rate, score, args, frozen_state="none"):
    model, batch = build(device, args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    sched = ILSScheduler(model, freeze_rate=rate, score=score, optimizer=opt, warmup_steps=0,
                         frozen_state=None if frozen_state == "none" else frozen_state)
    setup = _measure.Setup(model, batch, optimizer=opt, loss_fn=hidden_states_loss)
    train, step = _measure.time_interleaved(setup, [sched.step], warmup=args.warmup, reps=args.steps)
    n_trained = sched.num_layers - sched.num_frozen
    # back-to-back scheduler steps (no optimizer in between: detach the hook's skip logic)
    sched._guard.remove()
    sched._guard = None
    settings = Settings(cpu_warmup=1, cpu_min_reps=5, cpu_min_time_s=0.5, cpu_max_reps=50)
    iso = bench(sched.step, device, settings, use_triton=False)
    t_train, t_sched = train.ms, step.ms
    return {
        "layers": sched.num_layers, "n_trained": n_trained, "train_step_ms": t_train,
        "sched_step_ms": t_sched, "sched_isolated_ms": iso.ms, "ratio_pct": 100.0 * t_sched / t_train,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=None, help="default: 32 on cuda, 2 on cpu")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--steps", type=int, default=None, help="timed iterations per config (cuda 20, cpu 3)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rates", default="0.0,0.5,0.9")
    p.add_argument("--scores", default="relative,robust")
    p.add_argument("--frozen-states", default="none",
                   help="the scheduler's frozen_state per row: none (the default: the state in full), compress "
                        "(frozen layers' AdamW state 8-bit, encoded and decoded inside step()), auto, offload; "
                        "comma-separated")
    p.add_argument("--out", default=None, help="CSV path (default bench/results/scheduler_overhead_<cpu|gpu>.csv)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.batch is None:
        args.batch = 32 if device.type == "cuda" else 2
    if args.steps is None:
        args.steps = 20 if device.type == "cuda" else 3
    out = args.out or results_path("scheduler_overhead", "csv", device)

    ver = versions()
    dname = device_name(device)
    print(f"# scheduler overhead: BERT L={args.layers} H={args.hidden} batch={args.batch} seq={args.seq} fp32 "
          f"AdamW, on {dname}, torch {ver['torch']}, {now()}")
    hdr = (f"{'rate':>5} {'score':>9} {'frozen st':>9} {'trained':>9} {'train ms':>10} {'sched ms':>9} "
           f"{'isolated':>9} {'ratio':>8}")
    print(hdr)
    rows = []
    for rate in [float(r) for r in args.rates.split(",")]:
        for score in args.scores.split(","):
            for frozen_state in args.frozen_states.split(","):
                r = run_config(device, rate, score, args, frozen_state)
                print(f"{rate:>5.2f} {score:>9} {frozen_state:>9} {r['n_trained']:>4}/{r['layers']:<4} "
                      f"{r['train_step_ms']:>10.1f} {r['sched_step_ms']:>9.2f} {r['sched_isolated_ms']:>9.2f} "
                      f"{r['ratio_pct']:>7.2f}%")
                rows.append({"date": now(), "device": device.type, "device_name": dname, "torch": ver["torch"],
                             "cuda": ver["cuda"], "model": f"bert-L{args.layers}-H{args.hidden}",
                             "batch": args.batch, "seq": args.seq, "freeze_rate": rate, "score": score,
                             "frozen_state": frozen_state, **{
                                 k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}})
    write_rows(out, rows)
    print(f"# wrote {out}")
    return rows


if __name__ == "__main__":
    main()
