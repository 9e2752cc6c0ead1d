"""SlimFitConfig: what slimfit.patch changes, as one validated dataclass with named presets.

Flat fields for the per-layer choices; three parts, each a frozen dataclass that checks its own fields:
`attention` (AttentionSaving: slimfit's attention core, None = attention left alone), `sampling`
(LinearSampling: WTA-CRS sampled weight gradients, None = off) and `experimental` (ExperimentalSaving: the
research code's choices measured to cost accuracy, top-k of norm outputs and of P, dropout on V; off by
default)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ._config_base import ConfigBase, choice, flag, integer, read_version, real, refuse_unknown
from .autograd._common import NORM_SAVES
from .autograd.attention import PROBS_MODES
from .autograd.wta_crs import SAMPLERS
from .kernels.validation import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

# The allowed values are the ones the layers declare (declared once there); top-k is experimental here.
_BITS = (None, *SUPPORTED_BITS)
_LAYERNORM_SAVES = tuple(s for s in NORM_SAVES if s != "topk")
_PROBS = tuple(p for p in PROBS_MODES if p != "topk")
_TOPK_NORMS = ("none", "frozen", "trainable", "all")
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
    probs         saved attention probabilities on the materializing path: 'full', 'int8', 'int4', or
                  'recompute' (nothing kept: rebuilt in backward from the saved Q/K, one more Q·Kᵀ GEMM per
                  attention); top-k of P is experimental (ExperimentalSaving.topk_probs)
    path          'auto' (PyTorch's fused kernel with Q/K/V compressed wherever one exists and it keeps fewer
                  bytes, else the materializing core), 'fused' (wherever a kernel exists; warns when it falls
                  back), 'materialize' (always the core with compressed P); docs/attention.md
    """

    qkv_bits: int | None = None
    probs: str = "full"
    path: str = "auto"

    def __post_init__(self):
        _check_bits("AttentionSaving", "qkv_bits", self.qkv_bits)
        _refuse_experimental("AttentionSaving", "probs", self.probs, "topk_probs=True")
        choice("AttentionSaving", "probs", self.probs, _PROBS)
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


@dataclass(frozen=True)
class ExperimentalSaving:
    """The SlimFit research code's saving choices that slimfit measured to cost accuracy on pretrained models
    (docs/fidelity.md: they turn the gradient), kept for research and comparison (SlimFitConfig.experimental;
    the defaults change nothing). Each overrides the main field it names.

    topk_norms    which LayerNorm / RMSNorm save only the keep_ratio largest-magnitude entries of each row
                  of x̂: 'none', 'frozen' (weight frozen: the research code's), 'trainable', 'all';
                  overrides SlimFitConfig.layernorm_frozen / layernorm for those
    topk_probs    the materializing attention saves the keep_ratio largest entries of each row of P
                  (needs attention; overrides attention.probs)
    keep_ratio    the fraction of each row kept by either top-k, in (0, 1]
    dropout_on_v  attention dropout applied to V instead of P (the research code's trick; changes the
                  model; needs attention)
    """

    topk_norms: str = "none"
    topk_probs: bool = False
    keep_ratio: float = 0.1
    dropout_on_v: bool = False

    def __post_init__(self):
        choice("ExperimentalSaving", "topk_norms", self.topk_norms, _TOPK_NORMS)
        flag("ExperimentalSaving", "topk_probs", self.topk_probs)
        _check_fraction("ExperimentalSaving", "keep_ratio", self.keep_ratio, "the fraction of each row kept by "
                        "top-k")
        flag("ExperimentalSaving", "dropout_on_v", self.dropout_on_v)


def _refuse_experimental(owner: str, name: str, value, fix: str) -> None:
    """A ValueError for a top-k value given to a main field: it lives under ExperimentalSaving now."""
    if isinstance(value, str) and value == "topk":
        raise ValueError(f"{owner}.{name}='topk' is experimental (measured to cost accuracy: docs/fidelity.md); "
                         f"ask for it with SlimFitConfig(experimental=ExperimentalSaving({fix})) or "
                         f"cfg.with_experimental({fix})")


_PARTS = {"attention": AttentionSaving, "sampling": LinearSampling, "experimental": ExperimentalSaving}
# to_dict()'s "version": bumped when a saved field changes meaning; from_dict refuses versions it does not know.
# Version 1 had top-k and dropout on V among the main fields (read: _from_version_1).
CONFIG_VERSION = 2
@dataclass(frozen=True)
class SlimFitConfig(ConfigBase):
    """Which activations slimfit compresses. Fields left at their defaults change nothing
    except the frozen fast path of linear layers, which is lossless.

    linear_input_bits   saved input of trainable linear layers: None (full), 8 or 4 bits
    ffn_out_input_bits  saved input of the FFN output projection (the GELU output); None = as linear_input_bits
    gelu_bits           saved GELU input: None leaves GELU alone, else 8/4 bits
    silu_bits           saved SiLU input, and gate and up of a SwiGLU MLP's silu(gate) * up (Llama, Mistral,
                        Qwen2): None leaves them alone, else 8/4 bits (same semantics as gelu_bits)
    layernorm           what a LayerNorm / RMSNorm with trainable weight saves: 'full' (x̂ + rstd) or 'int8'
    layernorm_frozen    what a LayerNorm / RMSNorm with frozen weight saves ('full' or 'int8')
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
    experimental        ExperimentalSaving: the research code's top-k of norm outputs and of P, dropout on V,
                        measured to cost accuracy; its defaults change nothing

    Changing a config: `cfg.replace(gelu_bits=8)` for a flat field; `cfg.with_attention(probs="int8")` /
    `cfg.with_sampling(ratio=0.5)` / `cfg.with_experimental(topk_norms="frozen")` for a field of a part
    (turning the part on, from its defaults, when it was None); `cfg.replace(attention=None)` /
    `cfg.replace(sampling=None)` turn a part off.

    Convolutions (nn.Conv1d/2d/3d) with a frozen weight always take a lossless fast path that saves
    no activation (slimfit.autograd.conv); there is nothing to configure.
    """

    linear_input_bits: int | None = None
    ffn_out_input_bits: int | None = None
    gelu_bits: int | None = None
    silu_bits: int | None = None
    layernorm: str = "full"
    layernorm_frozen: str = "full"
    attention: AttentionSaving | None = None
    dropout: str = "seed"
    group_size: int = 128
    stochastic: bool = False
    check_finite: bool = False
    sampling: LinearSampling | None = None
    lm_head_chunk_rows: int | None = None
    experimental: ExperimentalSaving = ExperimentalSaving()

    CONFIG_NAME = CONFIG_NAME          # the JSON file of save_pretrained (not a field: no annotation)
    CONFIG_VERSION = CONFIG_VERSION

    def __post_init__(self):
        for name in ("linear_input_bits", "ffn_out_input_bits", "gelu_bits", "silu_bits"):
            _check_bits("SlimFitConfig", name, getattr(self, name))
        if 2 in (self.gelu_bits, self.silu_bits, self.linear_input_bits, self.ffn_out_input_bits):
            # 2-bit saved inputs are available as a kernel but too lossy for gradients here.
            raise ValueError("SlimFitConfig: 2-bit saved activations are not supported for linear/GELU/SiLU; "
                             "use 4 or 8")
        for name, fix in (("layernorm", "topk_norms='trainable'"), ("layernorm_frozen", "topk_norms='frozen'")):
            _refuse_experimental("SlimFitConfig", name, getattr(self, name), fix)
            choice("SlimFitConfig", name, getattr(self, name), _LAYERNORM_SAVES)
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
        if self.experimental is None:
            raise TypeError("SlimFitConfig.experimental must be ExperimentalSaving(...) (its defaults change "
                            "nothing), got None")
        exp = self.experimental
        if self.attention is None and (exp.topk_probs or exp.dropout_on_v):
            raise ValueError("SlimFitConfig.experimental: topk_probs and dropout_on_v act on slimfit's attention "
                             "core, which attention=None leaves out; set attention=AttentionSaving(...) too")

    # ------------------------------------------------------------------ what the patch applies
    def norm_save(self, frozen: bool) -> str:
        """What a norm saves (its weight frozen or trainable): the main field, or 'topk' where
        experimental.topk_norms names it."""
        topk = self.experimental.topk_norms in ("all", "frozen" if frozen else "trainable")
        return "topk" if topk else (self.layernorm_frozen if frozen else self.layernorm)

    @property
    def attention_probs(self) -> str | None:
        """How the materializing attention keeps P: attention.probs, or 'topk' with experimental.topk_probs
        (None without attention)."""
        if self.attention is None:
            return None
        return "topk" if self.experimental.topk_probs else self.attention.probs

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

    def with_experimental(self, **changes) -> "SlimFitConfig":
        """This config with `changes` to its ExperimentalSaving: `cfg.with_experimental(topk_norms="frozen")`."""
        return self._with_part("experimental", changes)

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
        if values.get("version") == 1:
            values = _from_version_1(values)
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
          in backward. Top-10% of P wrecks a ViT's gradient (`.with_experimental(topk_probs=True)` keeps
          it available)."""
        return cls(
            ffn_out_input_bits=8,
            gelu_bits=4,
            silu_bits=4,
            layernorm="int8",
            layernorm_frozen="int8",
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


def _from_version_1(values: dict) -> dict:
    """A version-1 dict in version 2's fields: 'topk' norm saves, their layernorm_keep_ratio, attention's
    'topk' probs, its keep_ratio and dropout_on_v move under experimental (the same patch)."""
    values = dict(values, version=CONFIG_VERSION)
    exp = dict(values.get("experimental") or {})
    norms = [name for name, field in (("trainable", "layernorm"), ("frozen", "layernorm_frozen"))
             if values.get(field) == "topk"]
    for field in ("layernorm", "layernorm_frozen"):
        if values.get(field) == "topk":
            values[field] = "full"
    ratios = {}
    norm_ratio = values.pop("layernorm_keep_ratio", None)
    if norms:
        exp["topk_norms"] = "all" if len(norms) == 2 else norms[0]
        ratios["layernorm_keep_ratio"] = norm_ratio
    attention = values.get("attention")
    if isinstance(attention, dict):
        attention = dict(attention)
        probs_ratio = attention.pop("keep_ratio", None)
        if attention.get("probs") == "topk":
            attention["probs"] = "full"
            exp["topk_probs"] = True
            ratios["attention.keep_ratio"] = probs_ratio
        if attention.pop("dropout_on_v", False):
            exp["dropout_on_v"] = True
        values["attention"] = attention
    kept = {r for r in ratios.values() if r is not None}
    if len(kept) > 1:
        raise ValueError(f"SlimFitConfig.from_dict: this version-1 config keeps top-k rows at two ratios "
                         f"({ratios}); ExperimentalSaving has one keep_ratio: edit the file to one ratio")
    if kept:
        exp["keep_ratio"] = kept.pop()
    if exp:
        values["experimental"] = exp
    return values
