"""SlimFitConfig: what slimfit.patch changes, as one validated dataclass with named presets."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

_BITS = (None, 2, 4, 8)
_LAYERNORM_SAVES = ("full", "int8", "topk")
_PROBS = ("full", "topk", "int8", "int4")
_DROPOUT = ("torch", "seed", "bitmask")
_GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class SlimFitConfig:
    """Which activations slimfit compresses. Fields left at their defaults change nothing
    except the frozen fast path of linear layers, which is lossless.

    linear_input_bits   saved input of trainable linear layers: None (full), 8 or 4 bits
    ffn_out_input_bits  saved input of the FFN output projection (the GELU output); None = as linear_input_bits
    gelu_bits           saved GELU input: None leaves GELU alone, else 8/4/2 bits
    layernorm           what a LayerNorm with trainable weight saves: 'full' (x̂ + rstd), 'int8', 'topk'
    layernorm_frozen    what a LayerNorm with frozen weight saves
    layernorm_keep_ratio  fraction of each row kept by 'topk'
    attention           route attention through slimfit's core (Q/K/V and P compressed)
    qkv_bits            saved Q, K, V: None (full) or 8/4 bits
    attn_probs          saved attention probabilities: 'full', 'topk', 'int8', 'int4'
    attn_keep_ratio     fraction of each row of P kept by 'topk'
    attn_dropout_on_v   apply attention dropout to V instead of P (the SlimFit code's trick; changes the model)
    dropout             'torch' (left alone), 'seed' (mask regenerated: 0 bytes), 'bitmask' (1 bit/element)
    group_size          quantization group size (32, 64, 128, 256)
    stochastic          stochastic rounding (unbiased) instead of round-to-nearest
    check_finite        raise on NaN/Inf activations (one host sync per quantize on CUDA)
    """

    linear_input_bits: int | None = None
    ffn_out_input_bits: int | None = None
    gelu_bits: int | None = None
    layernorm: str = "full"
    layernorm_frozen: str = "full"
    layernorm_keep_ratio: float = 0.1
    attention: bool = False
    qkv_bits: int | None = None
    attn_probs: str = "full"
    attn_keep_ratio: float = 0.1
    attn_dropout_on_v: bool = False
    dropout: str = "seed"
    group_size: int = 128
    stochastic: bool = False
    check_finite: bool = True

    def __post_init__(self):
        for name in ("linear_input_bits", "ffn_out_input_bits", "gelu_bits", "qkv_bits"):
            value = getattr(self, name)
            if value not in _BITS:
                raise ValueError(f"SlimFitConfig.{name} must be one of {_BITS}, got {value!r}")
        if self.gelu_bits == 2 or self.linear_input_bits == 2 or self.ffn_out_input_bits == 2:
            # 2-bit saved inputs are available as a kernel but too lossy for gradients here.
            raise ValueError("SlimFitConfig: 2-bit saved activations are not supported for linear/GELU; use 4 or 8")
        for name in ("layernorm", "layernorm_frozen"):
            if getattr(self, name) not in _LAYERNORM_SAVES:
                raise ValueError(f"SlimFitConfig.{name} must be one of {_LAYERNORM_SAVES}, got {getattr(self, name)!r}")
        if self.attn_probs not in _PROBS:
            raise ValueError(f"SlimFitConfig.attn_probs must be one of {_PROBS}, got {self.attn_probs!r}")
        if self.dropout not in _DROPOUT:
            raise ValueError(f"SlimFitConfig.dropout must be one of {_DROPOUT}, got {self.dropout!r}")
        for name in ("layernorm_keep_ratio", "attn_keep_ratio"):
            value = getattr(self, name)
            if not (0.0 < value <= 1.0):
                raise ValueError(f"SlimFitConfig.{name} must be in (0, 1], got {value!r}")
        if self.group_size not in _GROUP_SIZES:
            raise ValueError(f"SlimFitConfig.group_size must be one of {_GROUP_SIZES}, got {self.group_size!r}")
        if not self.attention and (self.qkv_bits is not None or self.attn_probs != "full" or self.attn_dropout_on_v):
            raise ValueError(
                "SlimFitConfig: qkv_bits / attn_probs / attn_dropout_on_v need attention=True "
                "(they configure slimfit's attention core)"
            )

    def replace(self, **changes) -> "SlimFitConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ presets
    @classmethod
    def exact(cls) -> "SlimFitConfig":
        """Only lossless savings: the frozen fast path and seed-regenerated dropout."""
        return cls(dropout="seed")

    @classmethod
    def paper(cls) -> "SlimFitConfig":
        """The settings of the SlimFit research code: 4-bit GELU input, 8-bit Q/K/V, P pruned
        top-10%, LayerNorm x̂ top-10% when frozen, 8-bit input of the FFN output projection.
        (Their fixed-point formats are replaced by per-group min/max: more accurate at equal bits.)"""
        return cls(
            ffn_out_input_bits=8,
            gelu_bits=4,
            layernorm="full",
            layernorm_frozen="topk",
            layernorm_keep_ratio=0.1,
            attention=True,
            qkv_bits=8,
            attn_probs="topk",
            attn_keep_ratio=0.1,
            dropout="seed",
        )

    @classmethod
    def aggressive(cls) -> "SlimFitConfig":
        """Most memory per accuracy: paper() plus 8-bit inputs of every trainable linear and
        8-bit LayerNorm x̂ when trainable, with P stored at 8 bits instead of top-10%: top-k P
        costs 0.6 bytes per score against 1 for int8, but its gradient error is ~7x larger
        (docs/attention.md), while 8-bit linear inputs save 3 bytes per element."""
        return cls.paper().replace(linear_input_bits=8, layernorm="int8", attn_probs="int8")

    @classmethod
    def preset(cls, name: str) -> "SlimFitConfig":
        presets = {"exact": cls.exact, "paper": cls.paper, "aggressive": cls.aggressive}
        if name not in presets:
            raise ValueError(f"unknown SlimFitConfig preset {name!r}; choose one of {sorted(presets)}")
        return presets[name]()
