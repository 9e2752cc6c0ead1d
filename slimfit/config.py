"""SlimFitConfig: what slimfit.patch changes, as one validated dataclass with named presets."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .autograd._common import NORM_SAVES
from .autograd.attention import PROBS_MODES
from .kernels.validation import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

# The allowed values are the ones the layers declare (declared once there).
_BITS = (None, *SUPPORTED_BITS)
_LAYERNORM_SAVES = NORM_SAVES
_PROBS = PROBS_MODES
_ATTENTION_PATHS = ("auto", "fused", "materialize")
_DROPOUT = ("torch", "seed", "bitmask")
_GROUP_SIZES = SUPPORTED_GROUP_SIZES
_SAMPLING = (None, "wta_crs", "crs")
_SAMPLE_TARGETS = ("paper", "all")
_SAMPLE_NORMS = ("token", "sample")
CONFIG_NAME = "slimfit_config.json"
_SAMPLE_DEFAULTS = {"sample_ratio": 0.3, "sample_min_rows": 10, "sample_targets": "paper", "sample_norms": "token"}


@dataclass(frozen=True)
class SlimFitConfig:
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
    attention           route attention through slimfit's core (Q/K/V and P compressed)
    qkv_bits            saved Q, K, V: None (full) or 8/4 bits
    attn_probs          saved attention probabilities: 'full', 'topk', 'int8', 'int4', or 'recompute' (nothing
                        kept: rebuilt in backward from the saved Q/K, one more Q·Kᵀ GEMM per attention)
    attn_keep_ratio     fraction of each row of P kept by 'topk'
    attn_dropout_on_v   apply attention dropout to V instead of P (the SlimFit code's trick; changes the model)
    attention_path      'auto' (PyTorch's fused kernel with Q/K/V compressed wherever one exists and it keeps
                        fewer bytes, else the materializing core), 'fused' (wherever a kernel exists; warns when
                        it falls back), 'materialize' (always the core with compressed P); docs/attention.md
    dropout             'torch' (left alone), 'seed' (mask regenerated: 0 bytes), 'bitmask' (1 bit/element)
    group_size          quantization group size (32, 64, 128, 256)
    stochastic          stochastic rounding (unbiased) instead of round-to-nearest
    check_finite        raise on NaN/Inf (or fp32-overflowing) saved activations; off by default because
                        each check reads a value on the host (one sync per compressed tensor on a GPU).
                        Off, non-finite inputs still give non-finite gradients (they are not hidden)
    linear_sampling     estimate the weight gradient of target linears from sampled token rows
                        (docs/wta_crs.md): None (off), 'wta_crs' or 'crs'
    sample_ratio        fraction of token rows kept by the sampled linears, in (0, 1]
    sample_min_rows     keep at least this many rows (an int >= 1)
    sample_targets      'paper' (attention output projection and the FFN linears of a known family, never
                        Q/K/V) or 'all' (every linear layer)
    sample_norms        stale gradient norms kept per 'token' or one per 'sample' (NormCache per_token)
    lm_head_chunk_rows  *ForCausalLM (Llama, Mistral, Qwen2/3, GPT-2) trained with labels: the loss through a chunked
                        linear + cross-entropy of this many rows at a time (the B·S·vocab logits are never kept;
                        training outputs then have logits=None; docs/decoders.md); None: the model's own head and loss

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
    attention: bool = False
    qkv_bits: int | None = None
    attn_probs: str = "full"
    attn_keep_ratio: float = 0.1
    attn_dropout_on_v: bool = False
    attention_path: str = "auto"
    dropout: str = "seed"
    group_size: int = 128
    stochastic: bool = False
    check_finite: bool = False
    linear_sampling: str | None = None
    sample_ratio: float = 0.3
    sample_min_rows: int = 10
    sample_targets: str = "paper"
    sample_norms: str = "token"
    lm_head_chunk_rows: int | None = None

    def __post_init__(self):
        for name in ("linear_input_bits", "ffn_out_input_bits", "gelu_bits", "silu_bits", "qkv_bits"):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in _BITS:
                raise ValueError(f"SlimFitConfig.{name} must be one of {_BITS}, got {value!r}")
        if 2 in (self.gelu_bits, self.silu_bits, self.linear_input_bits, self.ffn_out_input_bits):
            # 2-bit saved inputs are available as a kernel but too lossy for gradients here.
            raise ValueError("SlimFitConfig: 2-bit saved activations are not supported for linear/GELU/SiLU; "
                             "use 4 or 8")
        for name in ("layernorm", "layernorm_frozen"):
            if getattr(self, name) not in _LAYERNORM_SAVES:
                raise ValueError(f"SlimFitConfig.{name} must be one of {_LAYERNORM_SAVES}, got {getattr(self, name)!r}")
        if self.attn_probs not in _PROBS:
            raise ValueError(f"SlimFitConfig.attn_probs must be one of {_PROBS}, got {self.attn_probs!r}")
        if self.attention_path not in _ATTENTION_PATHS:
            raise ValueError(f"SlimFitConfig.attention_path must be one of {_ATTENTION_PATHS}, got {self.attention_path!r}")
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
        self._check_sampling()
        rows = self.lm_head_chunk_rows
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise ValueError(f"SlimFitConfig.lm_head_chunk_rows must be None or an int >= 1, got {rows!r}")

    def _check_sampling(self) -> None:
        if self.linear_sampling not in _SAMPLING:
            raise ValueError(f"SlimFitConfig.linear_sampling must be one of {_SAMPLING}, got {self.linear_sampling!r}")
        ratio = self.sample_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (0.0 < float(ratio) <= 1.0):
            raise ValueError(f"SlimFitConfig.sample_ratio must be a number in (0, 1] (the fraction of token rows "
                             f"kept for the weight gradient), got {ratio!r}")
        k_min = self.sample_min_rows
        if isinstance(k_min, bool) or not isinstance(k_min, int) or k_min < 1:
            raise ValueError(f"SlimFitConfig.sample_min_rows must be an int >= 1, got {k_min!r}")
        if self.sample_targets not in _SAMPLE_TARGETS:
            raise ValueError(f"SlimFitConfig.sample_targets must be one of {_SAMPLE_TARGETS}, got {self.sample_targets!r}")
        if self.sample_norms not in _SAMPLE_NORMS:
            raise ValueError(f"SlimFitConfig.sample_norms must be one of {_SAMPLE_NORMS}, got {self.sample_norms!r}")
        if self.linear_sampling is None:
            changed = [k for k, v in _SAMPLE_DEFAULTS.items() if getattr(self, k) != v]
            if changed:
                raise ValueError(f"SlimFitConfig: {', '.join(changed)} only apply with linear_sampling='wta_crs' "
                                 "or 'crs' (they configure the sampled weight gradients)")

    def replace(self, **changes) -> "SlimFitConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ checkpoints
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "SlimFitConfig":
        """A config from `to_dict()`'s output; keys it does not know are refused, by name."""
        if not isinstance(values, dict):
            raise TypeError(f"SlimFitConfig.from_dict expects a dict, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"SlimFitConfig: unknown field(s) {unknown} (written by another slimfit version?); "
                             f"known fields: {sorted(known)}")
        return cls(**values)

    def save_pretrained(self, save_directory) -> str:
        """Write the config as JSON to `save_directory`/slimfit_config.json (beside a model's
        save_pretrained files); returns the file's path."""
        import json
        import os

        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, CONFIG_NAME)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")
        return path

    @classmethod
    def from_pretrained(cls, path) -> "SlimFitConfig":
        """The config saved by `save_pretrained` (a directory holding slimfit_config.json, or the file)."""
        import json
        import os

        file = os.path.join(path, CONFIG_NAME) if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"SlimFitConfig.from_pretrained: no {CONFIG_NAME} at {path!r}")
        with open(file) as f:
            try:
                values = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"SlimFitConfig.from_pretrained: {file} is not valid JSON ({exc})") from None
        return cls.from_dict(values)

    # ------------------------------------------------------------------ presets
    @classmethod
    def exact(cls) -> "SlimFitConfig":
        """Only lossless savings: the frozen fast path and seed-regenerated dropout."""
        return cls(dropout="seed")

    @classmethod
    def paper(cls) -> "SlimFitConfig":
        """The SlimFit method's compressions where they cost no accuracy: 4-bit GELU input, 8-bit
        Q/K/V, 8-bit input of the FFN output projection, LayerNorm x̂ at 8 bits when frozen, P not
        kept (rebuilt in backward from Q̃, K̃). Llama-family models get the same treatment: 4-bit
        SiLU / SwiGLU inputs (as GELU's), RMSNorm x̂ as LayerNorm's. (The research code's
        fixed-point formats are replaced by per-group min/max: more accurate at equal bits.)

        Two choices differ from the research code, by measurement (bench/results/grad_fidelity_cpu.md,
        accuracy_*_cpu.md; docs/fidelity.md):
        * frozen LayerNorm x̂ at int8, not top-10%: top-10% turns DINOv2 ViT-S's gradient (cosine
          0.91 vs 1.000) and cost accuracy at 500 steps (Fashion-MNIST seed 0: -4.8 points against
          full fine-tuning, +4.0 with int8 x̂); int8 keeps ~0.4 byte per element more;
        * P recomputed, not int8 (nor top-10%): the gradient of attention at the dequantized point,
          3x closer to exact than int8 P on MiniLM (rel. error 1.2e-3 vs 3.4e-3), no S×S bytes at
          all, for one more Q·Kᵀ GEMM per attention in backward. Top-10% of P cost 28 points on
          Fashion-MNIST (`.replace(attn_probs="topk")` keeps it available)."""
        return cls(
            ffn_out_input_bits=8,
            gelu_bits=4,
            silu_bits=4,
            layernorm="full",
            layernorm_frozen="int8",
            layernorm_keep_ratio=0.1,
            attention=True,
            qkv_bits=8,
            attn_probs="recompute",
            dropout="seed",
            lm_head_chunk_rows=256,
        )

    @classmethod
    def aggressive(cls) -> "SlimFitConfig":
        """Most memory per accuracy: paper() plus 8-bit inputs of every trainable linear (3 bytes
        saved per element) and LayerNorm x̂ at 8 bits also when the weight trains. Measured as
        accurate as paper() (bench/results/accuracy_*_cpu.md) with fewer bytes."""
        return cls.paper().replace(linear_input_bits=8, layernorm="int8")

    @classmethod
    def wta_crs(cls) -> "SlimFitConfig":
        """paper() plus WTA-CRS sampled weight gradients (30% of the token rows) for the attention
        output projection and the FFN linears (docs/wta_crs.md). Pass sample ids (dataset indices)
        for the variance reduction: `model(**batch, sample_ids=idx)`."""
        return cls.paper().replace(linear_sampling="wta_crs", sample_ratio=0.3)

    @classmethod
    def preset(cls, name: str) -> "SlimFitConfig":
        presets = {"exact": cls.exact, "paper": cls.paper, "aggressive": cls.aggressive, "wta_crs": cls.wta_crs}
        if name not in presets:
            raise ValueError(f"unknown SlimFitConfig preset {name!r}; choose one of {sorted(presets)}")
        return presets[name]()
