"""Typed per-module options: what a patched module reads from the instance attribute `_slimfit`
(`modules.OPTIONS`) or, for attention, `_slimfit_attention` (`hf_attention.ATTENTION_OPTIONS`).

Frozen dataclasses built once per patch from the SlimFitConfig (`from_config`), read as attributes in
the forwards (`modules.py`, `hf_attention.py`, `torch_attention.py`). They pickle with the module.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import SlimFitConfig


@dataclass(frozen=True)
class Sampling:
    """WTA-CRS weight-gradient sampling of one linear (its `name` keys the shared sample-id holder)."""

    sampler: str
    ratio: float
    k_min: int
    ids: object  # sampling.SampleIds, shared by every sampled layer of the model
    name: str


@dataclass(frozen=True)
class LinearOptions:
    input_bits: int | None
    group_size: int
    stochastic: bool
    check_finite: bool = False
    sampling: Sampling | None = None

    @classmethod
    def from_config(cls, config: SlimFitConfig, input_bits: int | None, sampling: Sampling | None = None):
        return cls(input_bits=input_bits, group_size=config.group_size, stochastic=config.stochastic,
                   check_finite=config.check_finite, sampling=sampling)


@dataclass(frozen=True)
class ActivationOptions:
    """SiLU and the SwiGLU product: the input(s) saved at `bits`."""

    bits: int
    group_size: int
    stochastic: bool
    check_finite: bool = False

    @classmethod
    def from_config(cls, config: SlimFitConfig):
        return cls(bits=config.silu_bits, group_size=config.group_size, stochastic=config.stochastic,
                   check_finite=config.check_finite)


@dataclass(frozen=True)
class ExpertsOptions:
    """Mixture-of-experts layers with fused 3-D weights: each expert's gate_up and down projections as
    slimfit linears (a frozen weight saves nothing and computes no weight gradient), the gated product
    as the SwiGLU product."""

    gate_up: LinearOptions
    down: LinearOptions
    product: ActivationOptions

    @classmethod
    def from_config(cls, config: SlimFitConfig):
        down_bits = config.ffn_out_input_bits or config.linear_input_bits
        return cls(gate_up=LinearOptions.from_config(config, config.linear_input_bits),
                   down=LinearOptions.from_config(config, down_bits), product=ActivationOptions.from_config(config))


@dataclass(frozen=True)
class GELUOptions:
    bits: int
    approximate: str  # 'none' | 'tanh': the formula the original module computes
    group_size: int
    stochastic: bool
    check_finite: bool = False

    @classmethod
    def from_config(cls, config: SlimFitConfig, approximate: str):
        return cls(bits=config.gelu_bits, approximate=approximate, group_size=config.group_size,
                   stochastic=config.stochastic, check_finite=config.check_finite)


@dataclass(frozen=True)
class NormOptions:
    """LayerNorm and RMSNorm: x̂ saved as `save` (trainable weight) / `save_frozen`. For an RMSNorm, the
    attribute holding its epsilon and the offset its formula adds to the weight (Gemma's `1 + w`)."""

    save: str
    save_frozen: str
    keep_ratio: float
    group_size: int
    check_finite: bool = False
    eps_attribute: str = "variance_epsilon"
    weight_offset: float = 0.0

    @classmethod
    def from_config(cls, config: SlimFitConfig, **norm):
        return cls(save=config.layernorm, save_frozen=config.layernorm_frozen,
                   keep_ratio=config.layernorm_keep_ratio, group_size=config.group_size,
                   check_finite=config.check_finite, **norm)


@dataclass(frozen=True)
class ReLUOptions:
    """nn.ReLU: nothing to choose (a 1-bit mask is exact)."""


@dataclass(frozen=True)
class ConvOptions:
    """nn.Conv1d/2d/3d: nothing to choose (frozen fast path, PyTorch's conv when trainable)."""


@dataclass(frozen=True)
class DropoutOptions:
    mode: str  # SlimFitConfig.dropout: 'seed' | 'bitmask'

    @classmethod
    def from_config(cls, config: SlimFitConfig):
        return cls(mode=config.dropout)


@dataclass(frozen=True)
class AttentionOptions:
    qkv_bits: int | None
    probs: str
    keep_ratio: float
    group_size: int
    dropout_on_v: bool
    check_finite: bool = False
    path: str = "auto"  # SlimFitConfig.attention.path

    @classmethod
    def from_config(cls, config: SlimFitConfig):
        """The options of a config whose `attention` is an AttentionSaving (not None)."""
        saving = config.attention
        return cls(qkv_bits=saving.qkv_bits, probs=saving.probs, keep_ratio=saving.keep_ratio,
                   group_size=config.group_size, dropout_on_v=saving.dropout_on_v,
                   check_finite=config.check_finite, path=saving.path)

    @classmethod
    def of(cls, opts) -> AttentionOptions:
        """`opts` itself, or the options a dict of the same fields names (as older callers pass)."""
        return opts if isinstance(opts, cls) else cls(**opts)
