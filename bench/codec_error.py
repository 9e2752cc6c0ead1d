#!/usr/bin/env python
"""Round-trip error of the optimizer-moment codes (slimfit/optim/codec.py) on real AdamW moments.

MiniLM-L6 (offline assets) is fine-tuned on Rotten Tomatoes with torch's AdamW (batch 16, seq <= 64, lr 5e-5,
1 thread, seed 0) for --steps steps; every parameter's exp_avg and exp_avg_sq is then coded and restored with
each code (per parameter, as FrozenState holds them) and compared through what AdamW does with them: the
bias-corrected update u = m / (sqrt(v) + eps) at that step, with m restored (v exact) and with v restored
(m exact). This is the measurement behind dynamic_code.py's choice of sqrt(v) for the second moment.

One round trip favours nearest rounding (its error is at most half a gap, stochastic rounding's up to a whole
one). Under frozen_state="compress_all" the moments are decoded, updated and encoded again at every step, and
there nearest rounding drifts: a moment whose change per step is below half a gap stays where it is. So each
code also holds its own copy of both moments through the run, as compress_all would: every step decoded,
updated by AdamW's moment rule from the run's gradient and encoded again (stochastic: a new seed per step,
parameter and moment); the last two columns compare the update from those held moments with the exact one.

    python -m bench.codec_error                 # 100 steps; writes bench/results/codec_error_cpu.{csv,md}
    python -m bench.codec_error --quick         # a random-weight bert-tiny, 5 steps: a smoke test, nothing written

Columns
  u(m̂) err / u(v̂) err   ||u(restored) - u|| / ||u|| over all elements
  u(v̂)/u min, max        the elementwise ratio |u(m, v̂)| / |u(m, v)| (where u != 0): > 1 is v underestimated
  > 1.5, < 0.5           the share of elements whose update grows by more than 1.5x, shrinks below 0.5x
  v -> 0                 elements with v > 0 restored as 0 (each one's update explodes to m / eps)
  x fp32                 fp32 bytes over the code's bytes (both moments)
  held err               ||u(m̃, ṽ) - u|| / ||u||, m̃ and ṽ the moments held in the code since step 1
  held |u|               ||u(m̃, ṽ)|| / ||u||: below 1 when held second moments stay too large (nearest: a
                         decaying v stuck on its level), above when they fall too low
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/codec_error.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import sys

import torch

from bench import _results

BETAS, EPS = (0.9, 0.999), 1e-8
COLUMNS = ("code", "u(m̂) err", "u(v̂) err", "u(v̂)/u min", "u(v̂)/u max", "> 1.5", "< 0.5", "v -> 0", "x fp32",
           "held err", "held |u|")


def _codec(code: str, bits: int, stochastic: bool = True):
    from slimfit.optim import codec

    def restore(t: torch.Tensor, sqrt: bool, seed: int = 1) -> torch.Tensor:
        return codec.decode(codec.encode(t, sqrt=sqrt, seed=seed, group_size=_BLOCK[0], stochastic=stochastic,
                                         code=code, bits=bits))

    def nbytes(n: int) -> int:
        return codec.encoded_nbytes(n, _BLOCK[0], code, bits)

    return restore, nbytes


def _dynamic_on_v(bits: int):
    """The alternative dynamic_code.py rejected for the second moment: v itself coded with the unsigned map."""
    from slimfit.kernels import qmaps
    from slimfit.optim import codec

    def restore(t: torch.Tensor, sqrt: bool, seed: int = 1) -> torch.Tensor:
        if not sqrt:
            return codec.decode(codec.encode(t, sqrt=False, seed=seed, group_size=_BLOCK[0], code="dynamic",
                                             bits=bits, stochastic=False))
        q = qmaps.unsigned(bits)
        codes, absmax = torch.ops.slimfit.quantize_blockwise(t, q, _BLOCK[0])
        return torch.ops.slimfit.dequantize_blockwise(codes, absmax, q, _BLOCK[0], list(t.shape), t.dtype)

    return restore, lambda n: codec.encoded_nbytes(n, _BLOCK[0], "dynamic", bits)


_BLOCK = [128]
CODES = {
    "linear 8-bit (stochastic)": lambda: _codec("linear", 8),
    "linear 8-bit (nearest)": lambda: _codec("linear", 8, stochastic=False),
    "dynamic 8-bit (stochastic)": lambda: _codec("dynamic", 8),
    "dynamic 8-bit (nearest)": lambda: _codec("dynamic", 8, stochastic=False),
    "dynamic 8-bit, v for sqrt(v) (nearest)": lambda: _dynamic_on_v(8),
    "dynamic 4-bit (stochastic)": lambda: _codec("dynamic", 4),
    "dynamic 4-bit (nearest)": lambda: _codec("dynamic", 4, stochastic=False),
    "dynamic 4-bit, v for sqrt(v) (nearest)": lambda: _dynamic_on_v(4),
}
HELD = tuple(name for name in CODES if "v for sqrt(v)" not in name)   # the codes the held columns measure


class Held:
    """Both moments of every parameter as one code holds them under compress_all: zeros at first, then at
    every step AdamW's moment rule from the run's gradient and a round trip through the code (seed: step,
    parameter, moment)."""

    def __init__(self, name: str, params):
        self.restore = CODES[name]()[0]
        self.moments = {p: (torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(p, dtype=torch.float32))
                        for p in params}

    @torch.no_grad()
    def step(self, step: int) -> None:
        for i, (p, (m, v)) in enumerate(self.moments.items()):
            if p.grad is None:    # torch's AdamW leaves such a parameter's state alone
                continue
            g = p.grad.float()
            m = self.restore(m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0]), False, (step * 1000 + i) * 2)
            v = self.restore(v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1]), True, (step * 1000 + i) * 2 + 1)
            self.moments[p] = (m, v)

    def final(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(self.moments.values())


def _batches(quick: bool, steps: int):
    """(model, [batch dict with labels]) for the run: MiniLM-L6 on Rotten Tomatoes, or bert-tiny on random ids."""
    if quick:
        from slimfit import architectures as A

        model = A.build("bert-tiny", seed=0)
        return model, [A.make_inputs(model, A.TEXT_CLS, batch=4, seq_len=16, seed=s) for s in range(steps)]
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from slimfit.demo import assets

    path = assets.minilm_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    train, _ = assets.rotten_tomatoes(0, 16 * steps, 10)
    out = []
    for s in range(steps):
        rows = train[16 * s: 16 * (s + 1)]
        enc = tok([t for t, _ in rows], padding=True, truncation=True, max_length=64, return_tensors="pt")
        out.append({**enc, "labels": torch.tensor([y for _, y in rows])})
    return model, out


def train_moments(quick: bool, steps: int, log=print, held=()) -> tuple[list, dict]:
    """[(exp_avg, exp_avg_sq)] of every parameter after `steps` AdamW steps, and {code: the same list as that
    code held them through the run (Held)} for each name in ``held``."""
    torch.manual_seed(0)
    model, batches = _batches(quick, steps)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    holders = {name: Held(name, params) for name in held}
    opt = torch.optim.AdamW(params, lr=5e-5, betas=BETAS, eps=EPS, weight_decay=0.01)
    for s, batch in enumerate(batches):
        loss = model(**batch).loss
        loss.backward()
        for h in holders.values():
            h.step(s)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if s % 20 == 0:
            log(f"  step {s}: loss {float(loss.detach()):.4f}")
    stepped = [p for p in params if p in opt.state]
    exact = [(opt.state[p]["exp_avg"].detach(), opt.state[p]["exp_avg_sq"].detach()) for p in stepped]
    return exact, {name: [h.moments[p] for p in stepped] for name, h in holders.items()}


def _flat(moments, which: int) -> torch.Tensor:
    return torch.cat([pair[which].reshape(-1).float() for pair in moments])


def measure(moments, steps: int, name: str, held=None) -> list:
    """One table row: the update's errors through m̂ and v̂, the ratio's range and tails, zeros made, bytes;
    the update's error and size from the moments the code held through the run (``held``; "-" without)."""
    restore, nbytes = CODES[name]()
    m, v = _flat(moments, 0), _flat(moments, 1)
    m_hat = torch.cat([restore(a.reshape(-1), False) for a, _ in moments])
    v_hat = torch.cat([restore(b.reshape(-1), True) for _, b in moments])
    bc1, bc2 = 1 - BETAS[0] ** steps, 1 - BETAS[1] ** steps

    def update(mm, vv):
        return (mm / bc1) / ((vv / bc2).sqrt() + EPS)

    u = update(m, v)
    held_cols = ["-", "-"]
    if held is not None:
        u_held = update(_flat(held, 0), _flat(held, 1))
        held_cols = [f"{float((u_held - u).norm() / u.norm()):.4f}", f"{float(u_held.norm() / u.norm()):.3f}"]
    err_m = float((update(m_hat, v) - u).norm() / u.norm())
    u_v = update(m, v_hat)
    ratio = (u_v.abs() / u.abs())[u != 0]
    zeros = int(((v_hat == 0) & (v > 0)).sum())
    fp32 = 8 * m.numel() / sum(2 * nbytes(a.numel()) for a, _ in moments)
    return [name, f"{err_m:.4f}", f"{float((u_v - u).norm() / u.norm()):.4f}", f"{float(ratio.min()):.3f}",
            f"{float(ratio.max()):.3f}", f"{float((ratio > 1.5).float().mean()):.1e}",
            f"{float((ratio < 0.5).float().mean()):.1e}", str(zeros), f"{fp32:.2f}", *held_cols]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="AdamW steps before the moments are measured (100)")
    p.add_argument("--block", type=int, default=128, help="group / block size of every code (128)")
    p.add_argument("--quick", action="store_true", help="bert-tiny with random weights, 5 steps; writes nothing")
    p.add_argument("--out-dir", default=None, help="where to write codec_error_cpu.{csv,md} (default bench/results; "
                                                   "--quick writes only here)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    _BLOCK[0] = args.block
    steps = 5 if args.quick else args.steps
    torch.set_num_threads(1)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    moments, held = train_moments(args.quick, steps, log, HELD)
    n = sum(a.numel() for a, _ in moments)
    rows = [measure(moments, steps, name, held.get(name)) for name in CODES]
    what = "bert-tiny (random weights, random ids)" if args.quick else "MiniLM-L6 on Rotten Tomatoes"
    head = (f"AdamW moments of {what} after {steps} steps ({n:,} elements per moment), block {args.block}; "
            f"update u = m / (sqrt(v) + eps) bias-corrected at step {steps}")
    print(head)
    print("\n".join(_results.text_table(COLUMNS, rows, right=range(1, len(COLUMNS)))))
    out_dir = args.out_dir or (None if args.quick else _results.RESULTS_DIR)
    if out_dir:
        csv_path = _results.results_path("codec_error", "csv", torch.device("cpu"), out_dir)
        _results.write_rows(csv_path, [dict(zip(COLUMNS, r)) for r in rows], list(COLUMNS))
        md = ["# Optimizer-moment codes: round-trip error on real AdamW moments", "", f"- {head}",
              f"- Versions: torch {_results.versions()['torch']}; date {_results.now()}",
              f"- Command: `{_results.command('codec_error', argv)}`", "",
              *_results.md_table(COLUMNS, rows, right=range(1, len(COLUMNS))), ""]
        md_path = _results.results_path("codec_error", "md", torch.device("cpu"), out_dir)
        _results.write_text(md_path, "\n".join(md))
        print(f"wrote {csv_path}, {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
