"""SlimFitConfig: what slimfit.patch changes, as one validated dataclass with named presets.

Flat fields for the per-layer choices; two optional parts, each a frozen dataclass that checks its own
fields: `attention` (AttentionSaving: slimfit's attention core, None = attention left alone) and
`sampling` (LinearSampling: WTA-CRS sampled weight gradients, None = off)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ._config_base import ConfigBase, choice, flag, integer, read_version, real, refuse_unknown
from .autograd._common import NORM_SAVES
from .autograd.attention import PROBS_MODES
from .autograd.wta_crs import SAMPLERS
from .kernels.validation import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

# The allowed values are the ones the layers declare (declared once there).
_BITS = (None, *SUPPORTED_BITS)
_LAYERNORM_SAVES = NORM_SAVES
_PROBS = PROBS_MODES
ATTENTION_PATHS = ("auto", "fused", "materialize")  # patching/attention/hf_attention.choose_path's choices
_DROPOUT = ("torch", "seed", "bitmask")
_GROUP_SIZES = SUPPORTED_GROUP_SIZES
_SAMPLE_METHODS = SAMPLERS
_SAMPLE_TARGETS = ("paper", "all")
_SAMPLE_NORMS = ("token", "sample")
CONFIG_NAME = "slimfit_config.json"


# The checks (slimfit/_config_base.py) are the scheduler's: each error names the field, the rule, the value
# with its type, and a fix where one exists.
def _check_bits(owner: str, name: str, value) -> None:
    choice(owner, name, value, _BITS)


def _check_fraction(owner: str, name: str, value, meaning: str) -> None:
    real(owner, name, value, f"a number in (0, 1] ({meaning})", lambda r: 0.0 < r <= 1.0, 0.1)


@dataclass(frozen=True)
class AttentionSaving:
    """What slimfit's attention core saves (SlimFitConfig.attention; None there leaves attention alone).
    The defaults compress nothing: AttentionSaving() routes attention through slimfit, Q/K/V and P kept.

    qkv_bits      saved Q, K, V: None (full) or 8/4/2 bits
    probs         saved attention probabilities on the materializing path: 'full', 'topk', 'int8', 'int4',
                  or 'recompute' (nothing kept: rebuilt in backward from the saved Q/K, one more Q·Kᵀ GEMM
                  per attention)
    keep_ratio    fraction of each row of P kept by probs='topk'
    dropout_on_v  apply attention dropout to V instead of P (the SlimFit code's trick; changes the model)
    path          'auto' (PyTorch's fused kernel with Q/K/V compressed wherever one exists and it keeps fewer
                  bytes, else the materializing core), 'fused' (wherever a kernel exists; warns when it falls
                  back), 'materialize' (always the core with compressed P); docs/attention.md
    """

    qkv_bits: int | None = None
    probs: str = "full"
    keep_ratio: float = 0.1
    dropout_on_v: bool = False
    path: str = "auto"

    def __post_init__(self):
        _check_bits("AttentionSaving", "qkv_bits", self.qkv_bits)
        choice("AttentionSaving", "probs", self.probs, _PROBS)
        _check_fraction("AttentionSaving", "keep_ratio", self.keep_ratio, "the fraction of each row of P kept")
        flag("AttentionSaving", "dropout_on_v", self.dropout_on_v)
        choice("AttentionSaving", "path", self.path, ATTENTION_PATHS)


@dataclass(frozen=True)
class LinearSampling:
    """WTA-CRS sampled weight gradients of target linears (SlimFitConfig.sampling; None there = off;
    docs/wta_crs.md).

    method    'wta_crs' or 'crs'
    ratio     fraction of token rows kept by the sampled linears, in (0, 1]
    min_rows  keep at least this many rows (an int >= 1)
    targets   'paper' (attention output projection and the FFN linears of a known family, never Q/K/V)
              or 'all' (every linear layer)
    norms     stale gradient norms kept per 'token' or one per 'sample' (NormCache per_token)
    """

    method: str = "wta_crs"
    ratio: float = 0.3
    min_rows: int = 10
    targets: str = "paper"
    norms: str = "token"

    def __post_init__(self):
        choice("LinearSampling", "method", self.method, _SAMPLE_METHODS)
        _check_fraction("LinearSampling", "ratio", self.ratio, "the fraction of token rows kept for the weight "
                        "gradient")
        integer("LinearSampling", "min_rows", self.min_rows, 1, "token rows kept at least", 10)
        choice("LinearSampling", "targets", self.targets, _SAMPLE_TARGETS)
        choice("LinearSampling", "norms", self.norms, _SAMPLE_NORMS)


_PARTS = {"attention": AttentionSaving, "sampling": LinearSampling}
# to_dict()'s "version": bumped when a saved field changes meaning; from_dict refuses versions it does not know.
CONFIG_VERSION = 1
@dataclass(frozen=True)
class SlimFitConfig(ConfigBase):
    """Which activations slimfit compresses. Fields left at their defaults change nothing
    except the frozen fast path of linear layers, which is lossless.

    linear_input_bits   saved input of trainable linear layers: None (full), 8 or 4 bits
    ffn_out_input_bits  saved input of the FFN output projection (the GELU output); None = as linear_input_bits
    gelu_bits           saved GELU input: None leaves GELU alone, else 8/4 bits
    silu_bits           saved SiLU input, and gate and up of a SwiGLU MLP's silu(gate) * up (Llama, Mistral,
                        Qwen2): None leaves them alone, else 8/4 bits (same semantics as gelu_bits)
    layernorm           what a LayerNorm / RMSNorm with trainable weight saves: 'full' (x̂ + rstd), 'int8', 'topk'
    layernorm_frozen    what a LayerNorm / RMSNorm with frozen weight saves
    layernorm_keep_ratio  fraction of each row kept by 'topk'
    attention           AttentionSaving: route attention through slimfit's core, Q/K/V and P saved as it says;
                        None (default): attention left alone
    dropout             'torch' (left alone), 'seed' (mask regenerated: 0 bytes), 'bitmask' (1 bit/element)
    group_size          quantization group size (32, 64, 128, 256)
    stochastic          stochastic rounding (unbiased) instead of round-to-nearest
    check_finite        raise on NaN/Inf saved activations; off by default because
                        each check reads a value on the host (one sync per compressed tensor on a GPU).
                        Off, non-finite inputs still give non-finite gradients (they are not hidden)
    sampling            LinearSampling: estimate the weight gradient of target linears from sampled token rows
                        (docs/wta_crs.md); None (default): off
    lm_head_chunk_rows  a transformers causal LM trained with labels: the loss through a chunked
                        linear + cross-entropy of this many rows at a time (the B·S·vocab logits are never kept;
                        training outputs then have logits=None; docs/decoders.md); None: the model's own head and loss

    Changing a config: `cfg.replace(gelu_bits=8)` for a flat field; `cfg.with_attention(probs="int8")` /
    `cfg.with_sampling(ratio=0.5)` for a field of a part (turning the part on, from its defaults, when it
    was None); `cfg.replace(attention=None)` / `cfg.replace(sampling=None)` turn a part off.

    Convolutions (nn.Conv1d/2d/3d) with a frozen weight always take a lossless fast path that saves
    no activation (slimfit.autograd.conv); there is nothing to configure.
    """

    linear_input_bits: int | None = None
    ffn_out_input_bits: int | None = None
    gelu_bits: int | None = None
    silu_bits: int | None = None
    layernorm: str = "full"
    layernorm_frozen: str = "full"
    layernorm_keep_ratio: float = 0.1
    attention: AttentionSaving | None = None
    dropout: str = "seed"
    group_size: int = 128
    stochastic: bool = False
    check_finite: bool = False
    sampling: LinearSampling | None = None
    lm_head_chunk_rows: int | None = None

    CONFIG_NAME = CONFIG_NAME          # the JSON file of save_pretrained (not a field: no annotation)
    CONFIG_VERSION = CONFIG_VERSION

    def __post_init__(self):
        for name in ("linear_input_bits", "ffn_out_input_bits", "gelu_bits", "silu_bits"):
            _check_bits("SlimFitConfig", name, getattr(self, name))
        if 2 in (self.gelu_bits, self.silu_bits, self.linear_input_bits, self.ffn_out_input_bits):
            # 2-bit saved inputs are available as a kernel but too lossy for gradients here.
            raise ValueError("SlimFitConfig: 2-bit saved activations are not supported for linear/GELU/SiLU; "
                             "use 4 or 8")
        for name in ("layernorm", "layernorm_frozen"):
            choice("SlimFitConfig", name, getattr(self, name), _LAYERNORM_SAVES)
        _check_fraction("SlimFitConfig", "layernorm_keep_ratio", self.layernorm_keep_ratio,
                        "the fraction of each row kept by 'topk'")
        choice("SlimFitConfig", "dropout", self.dropout, _DROPOUT)
        choice("SlimFitConfig", "group_size", self.group_size, _GROUP_SIZES)
        for name, part in _PARTS.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, part):
                hint = (f" ({name}=True is now {name}={part.__name__}(), {name}=False is {name}=None)"
                        if isinstance(value, bool) else "")
                raise TypeError(f"SlimFitConfig.{name} must be None or {part.__name__}(...), got "
                                f"{type(value).__name__} {value!r}{hint}")
        integer("SlimFitConfig", "lm_head_chunk_rows", self.lm_head_chunk_rows, 1, "rows of the chunked LM head "
                "per chunk", 256, optional=True)

    def replace(self, **changes) -> "SlimFitConfig":
        """This config with flat fields (or whole parts: attention=..., sampling=...) changed."""
        return dataclasses.replace(self, **changes)

    def with_attention(self, **changes) -> "SlimFitConfig":
        """This config with `changes` to its AttentionSaving (from AttentionSaving()'s defaults when
        attention is None): `cfg.with_attention(probs="int8")`; `cfg.with_attention()` turns it on."""
        return self._with_part("attention", changes)

    def with_sampling(self, **changes) -> "SlimFitConfig":
        """This config with `changes` to its LinearSampling (from LinearSampling()'s defaults, method
        'wta_crs', when sampling is None): `cfg.with_sampling(ratio=0.5)`."""
        return self._with_part("sampling", changes)

    def _with_part(self, name: str, changes: dict) -> "SlimFitConfig":
        part = getattr(self, name)
        part = _PARTS[name]() if part is None else part
        return self.replace(**{name: dataclasses.replace(part, **changes)})

    # ------------------------------------------------------------------ checkpoints
    def to_dict(self) -> dict:
        """The nested form: each part a dict of its fields, or None; with the format's `version`."""
        return {**dataclasses.asdict(self), "version": CONFIG_VERSION}

    @classmethod
    def from_dict(cls, values: dict, /, **changes) -> "SlimFitConfig":
        """A config from `to_dict()`'s output, with `changes` (fields by name) applied; keys it does not
        know, and versions it does not know, are refused by name. save_pretrained / from_pretrained
        (slimfit_config.json) are ConfigBase's (slimfit/_config_base.py), over these two."""
        if not isinstance(values, dict):
            raise TypeError(f"SlimFitConfig.from_dict expects a dict, got {type(values).__name__}")
        values = dict(values)
        read_version("SlimFitConfig", values, CONFIG_VERSION)
        refuse_unknown("SlimFitConfig", values, _field_names(cls))
        for name in _PARTS:
            if isinstance(values.get(name), dict):
                values[name] = _part_from_dict(name, values[name])
        return cls(**{**values, **changes})

    # ------------------------------------------------------------------ presets
    @classmethod
    def exact(cls) -> "SlimFitConfig":
        """Only lossless savings: the frozen fast path and seed-regenerated dropout."""
        return cls(dropout="seed")

    @classmethod
    def paper(cls) -> "SlimFitConfig":
        """The SlimFit method's compressions where they cost no accuracy: 4-bit GELU input, 8-bit
        Q/K/V, 8-bit input of the FFN output projection, LayerNorm x̂ at 8 bits, P not kept (rebuilt
        in backward from Q̃, K̃). Llama-family models get the same treatment: 4-bit
        SiLU / SwiGLU inputs (as GELU's), RMSNorm x̂ as LayerNorm's. (The research code's
        fixed-point formats are replaced by per-group min/max: more accurate at equal bits.)

        Three choices differ from the research code, each for its gradient error and its accuracy
        (docs/fidelity.md, "Compression: what paper() keeps"):
        * frozen LayerNorm x̂ at int8, not top-10%: top-10% turns a ViT's weight gradient and costs
          accuracy; int8 keeps ~0.4 byte per element more;
        * trained LayerNorm x̂ at int8 too, not in full: the gradients barely move, and the scheduler
          trains every norm weight every step by default (``scheduled_kinds``), so a full x̂ would cost
          3 bytes per element of every norm input;
        * P recomputed, not int8 (nor top-10%): the exact gradient of attention at the dequantized
          point, closer to exact than int8 P, no S×S bytes at all, for one more Q·Kᵀ GEMM per attention
          in backward. Top-10% of P wrecks a ViT's gradient (`.with_attention(probs="topk")` keeps it
          available)."""
        return cls(
            ffn_out_input_bits=8,
            gelu_bits=4,
            silu_bits=4,
            layernorm="int8",
            layernorm_frozen="int8",
            layernorm_keep_ratio=0.1,
            attention=AttentionSaving(qkv_bits=8, probs="recompute"),
            dropout="seed",
            lm_head_chunk_rows=256,
        )

    @classmethod
    def aggressive(cls) -> "SlimFitConfig":
        """Most memory per accuracy: paper() plus 8-bit inputs of every trainable linear (3 bytes
        saved per element). Measured as accurate as paper() (bench/results/accuracy_*_cpu.md) with
        fewer bytes."""
        return cls.paper().replace(linear_input_bits=8)

    @classmethod
    def wta_crs(cls) -> "SlimFitConfig":
        """paper() plus WTA-CRS sampled weight gradients (30% of the token rows) for the attention
        output projection and the FFN linears (docs/wta_crs.md). Pass sample ids (dataset indices)
        for the variance reduction: `model(**batch, sample_ids=idx)`."""
        return cls.paper().replace(sampling=LinearSampling(method="wta_crs", ratio=0.3))

    @classmethod
    def preset(cls, name: str) -> "SlimFitConfig":
        presets = {"exact": cls.exact, "paper": cls.paper, "aggressive": cls.aggressive, "wta_crs": cls.wta_crs}
        if name not in presets:
            raise ValueError(f"unknown SlimFitConfig preset {name!r}; choose one of {sorted(presets)}")
        return presets[name]()


def _field_names(cls) -> frozenset:
    return frozenset(f.name for f in dataclasses.fields(cls))


def _part_from_dict(name: str, values: dict):
    refuse_unknown(f"SlimFitConfig.{name}", values, _field_names(_PARTS[name]))
    return _PARTS[name](**values)
