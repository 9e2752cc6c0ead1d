"""Typed per-module options: what a patched module reads from the instance attribute `_slimfit`
(`modules.OPTIONS`) or, for attention, `_slimfit_attention` (`attention.ATTENTION_OPTIONS`).

Frozen dataclasses built once per patch from the SlimFitConfig (`from_config`). Each one is, or holds,
the options object of the slimfit.autograd function the module calls (checked once, when built), and the
forwards (`modules.py`, `experts.py`, `attention/hf_attention.py`, `attention/torch_attention.py`) hand that
object down as `options=`: config -> these options -> the autograd Function, one copy, no keyword re-spread or re-check
per call. They pickle with the module.

    LinearOptions      is an autograd LinearOptions, plus the WTA-CRS `sampling` (its SampledLinearOptions
                       built once, `sampled`)
    GELUOptions        is an autograd GELUOptions
    ActivationOptions  is an autograd SwiGLUOptions (so also a SiLUOptions): SiLU and the SwiGLU product
    NormOptions        holds the LayerNormOptions of a trainable and of a frozen weight, plus an RMSNorm's
                       epsilon attribute and weight offset
    DropoutOptions     is an autograd DropoutOptions
    AttentionOptions   holds the materializing path's AttentionOptions and the fused path's
                       FusedAttentionOptions, plus the path rule
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import autograd
from ..config import SlimFitConfig


def _shared(config: SlimFitConfig, stochastic: bool = True) -> dict:
    """The fields every compressing option takes from the config alike: group_size and check_finite, and
    stochastic (rounding) for the options that round (`stochastic=False`: a norm's or attention's, which
    do not take it)."""
    shared = {"group_size": config.group_size, "check_finite": config.check_finite}
    if stochastic:
        shared["stochastic"] = config.stochastic
    return shared


@dataclass(frozen=True)
class Sampling:
    """WTA-CRS weight-gradient sampling of one linear (its `name` keys the shared sample-id holder)."""

    sampler: str
    ratio: float
    k_min: int
    ids: object  # sampling.SampleIds, shared by every sampled layer of the model
    name: str


@dataclass(frozen=True)
class LinearOptions(autograd.LinearOptions):
    """slimfit.autograd.LinearOptions (input_bits, group_size, stochastic, check_finite) plus, for a WTA-CRS
    target, its `sampling`; `sampled` is the sampled linear's options, made from both once, here."""

    sampling: Sampling | None = None
    sampled: autograd.SampledLinearOptions | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        if self.sampling is not None:
            object.__setattr__(self, "sampled", autograd.SampledLinearOptions(
                input_bits=self.input_bits, group_size=self.group_size, stochastic=self.stochastic,
                check_finite=self.check_finite, ratio=self.sampling.ratio, k_min=self.sampling.k_min,
                sampler=self.sampling.sampler))

    @classmethod
    def from_config(cls, config: SlimFitConfig, input_bits: int | None, sampling: Sampling | None = None):
        return cls(input_bits=input_bits, sampling=sampling, **_shared(config))


@dataclass(frozen=True)
class ActivationOptions(autograd.SwiGLUOptions):
    """SiLU and the SwiGLU product: the input(s) saved at `bits`. A SwiGLUOptions (up saved at `bits` too),
    and so a SiLUOptions: `silu` and `swiglu` both take it."""

    @classmethod
    def from_config(cls, config: SlimFitConfig):
        return cls(bits=config.silu_bits, **_shared(config))


class GeGLUOptions(autograd.GeGLUOptions):
    """The GELU-gated product of a GeGLU MLP: gate and up saved at `gelu_bits`, the GELU's approximation
    the one its activation computes."""

    @classmethod
    def from_config(cls, config: SlimFitConfig, approximate: str):
        return cls(bits=config.gelu_bits, approximate=approximate, **_shared(config))


@dataclass(frozen=True)
class LayerScaleOptions(autograd.LayerScaleOptions):
    """A per-channel scale's input saved at `ffn_out_input_bits` for the scale's gradient (the same precision
    paper() gives the FFN output projection's input, which the scale multiplies); `weight_attribute` names
    the module's one parameter."""

    weight_attribute: str = "weight"

    @classmethod
    def from_config(cls, config: SlimFitConfig, weight_attribute: str):
        return cls(bits=config.ffn_out_input_bits, weight_attribute=weight_attribute, **_shared(config))


@dataclass(frozen=True)
class ExpertsOptions:
    """Mixture-of-experts layers with fused 3-D weights: each expert's gate_up and down projections as
    slimfit linears (a frozen weight saves nothing and computes no weight gradient), the gated product
    as the SwiGLU product, and the routing product (each expert's output rows times their routing
    weights) with the rows saved at the FFN output side's bits, `ffn_out_input_bits` (in full when None)."""

    gate_up: LinearOptions
    down: LinearOptions
    product: ActivationOptions
    routing: autograd.RowScaleOptions

    @classmethod
    def from_config(cls, config: SlimFitConfig):
        down_bits = config.ffn_out_input_bits or config.linear_input_bits
        routing = autograd.RowScaleOptions(bits=config.ffn_out_input_bits, **_shared(config))
        return cls(gate_up=LinearOptions.from_config(config, config.linear_input_bits),
                   down=LinearOptions.from_config(config, down_bits), product=ActivationOptions.from_config(config),
                   routing=routing)


@dataclass(frozen=True)
class GELUOptions(autograd.GELUOptions):
    """slimfit.autograd.GELUOptions: bits, approximate ('none' | 'tanh': the formula the original module
    computes), group_size, stochastic, check_finite."""

    @classmethod
    def from_config(cls, config: SlimFitConfig, approximate: str):
        return cls(bits=config.gelu_bits, approximate=approximate, **_shared(config))


@dataclass(frozen=True)
class NormOptions:
    """LayerNorm and RMSNorm: x̂ saved as `save` (trainable weight) / `save_frozen`. For an RMSNorm, the
    attribute holding its epsilon and the offset its formula adds to the weight (Gemma's `1 + w`).
    `trainable` / `frozen` are the autograd LayerNormOptions of the two cases (rms_norm takes them too),
    made once, here; `kernel(weight_trains)` picks one."""

    save: str
    save_frozen: str
    keep_ratio: float
    group_size: int
    check_finite: bool = False
    eps_attribute: str = "variance_epsilon"
    weight_offset: float = 0.0
    eps: float | None = None   # a norm whose epsilon is a constant in its code (found by the patch-time probe)
    trainable: autograd.LayerNormOptions = field(init=False, repr=False, compare=False)
    frozen: autograd.LayerNormOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        for name, save in (("trainable", self.save), ("frozen", self.save_frozen)):
            object.__setattr__(self, name, autograd.LayerNormOptions(
                save=save, keep_ratio=self.keep_ratio, group_size=self.group_size, check_finite=self.check_finite))

    def kernel(self, weight_trains: bool) -> autograd.LayerNormOptions:
        """The options of a forward whose weight trains (or not): the scheduler may flip it every step."""
        return self.trainable if weight_trains else self.frozen

    @classmethod
    def from_config(cls, config: SlimFitConfig, **norm):
        return cls(save=config.norm_save(frozen=False), save_frozen=config.norm_save(frozen=True),
                   keep_ratio=config.experimental.keep_ratio, **_shared(config, stochastic=False), **norm)


@dataclass(frozen=True)
class ReLUOptions:
    """nn.ReLU: nothing to choose (a 1-bit mask is exact)."""


@dataclass(frozen=True)
class ConvOptions:
    """nn.Conv1d/2d/3d: nothing to choose (frozen fast path, PyTorch's conv when trainable)."""


@dataclass(frozen=True)
class DropoutOptions(autograd.DropoutOptions):
    """slimfit.autograd.DropoutOptions: mode, SlimFitConfig.dropout ('seed' | 'bitmask')."""

    @classmethod
    def from_config(cls, config: SlimFitConfig):
        return cls(mode=config.dropout)


@dataclass(frozen=True)
class AttentionOptions:
    """SlimFitConfig.attention for one model: the fields as the config names them, and, made once from
    them here, the options of each path: `materialize` (autograd.AttentionOptions: Q/K/V bits, how P is
    kept, dropout on P or on V) and `fused` (autograd.FusedAttentionOptions: Q/K/V bits, recompute backward).
    `path` is hf_attention.choose_path's rule."""

    qkv_bits: int | None
    probs: str
    keep_ratio: float
    group_size: int
    dropout_on_v: bool
    check_finite: bool = False
    path: str = "auto"  # SlimFitConfig.attention.path
    materialize: autograd.AttentionOptions = field(init=False, repr=False, compare=False)
    fused: autograd.FusedAttentionOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "materialize", autograd.AttentionOptions(
            qkv_bits=self.qkv_bits, probs=self.probs, keep_ratio=self.keep_ratio, group_size=self.group_size,
            dropout_mode="on_v" if self.dropout_on_v else "seed", check_finite=self.check_finite))
        object.__setattr__(self, "fused", autograd.FusedAttentionOptions(
            qkv_bits=self.qkv_bits, group_size=self.group_size, check_finite=self.check_finite))

    @classmethod
    def from_config(cls, config: SlimFitConfig):
        """The options of a config whose `attention` is an AttentionSaving (not None)."""
        saving, exp = config.attention, config.experimental
        return cls(qkv_bits=saving.qkv_bits, probs=config.attention_probs, keep_ratio=exp.keep_ratio,
                   dropout_on_v=exp.dropout_on_v, path=saving.path, **_shared(config, stochastic=False))

    @classmethod
    def of(cls, opts) -> AttentionOptions:
        """`opts` itself, or the options a dict of the same fields names (as older callers pass)."""
        return opts if isinstance(opts, cls) else cls(**opts)
