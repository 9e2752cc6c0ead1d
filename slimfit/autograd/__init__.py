"""torch.autograd.Functions that compute the forward exactly and save only compressed tensors.

    linear(x, weight, bias=None, *, input_bits=None, group_size=128, stochastic=False)
    gelu(x, *, bits=4, approximate='none', group_size=128, stochastic=False)
    layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, save='int8', keep_ratio=0.1, ...)
    rms_norm(x, weight=None, eps=1e-6, *, save='int8', keep_ratio=0.1, ...)     (LlamaRMSNorm, bit-exact)
    silu(x, *, bits=4, group_size=128, stochastic=False)
    swiglu(gate, up, *, bits=4, up_bits=None, group_size=128, stochastic=False)  (silu(gate) * up)
    geglu(gate, up, *, approximate='tanh', bits=4, ...)                         (gelu(gate) * up: Gemma)
    conv(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1)      (frozen weight: 0 bytes)
    dropout(x, p=0.5, training=True, *, mode='seed', seed=None)
    matmul(a, b, *, a_bits=None, b_bits=None, group_size=128, stochastic=False)
    row_scale(y, w, *, bits=8, ...)   (y * w[..., None]: the routing product of a mixture of experts)
    grouped_linear(x, weight, offsets, *, gather=None, mm=None, input_bits=None, ...)   (rows sorted by expert)
    attention(...)  (slimfit/autograd/attention.py)
    linear_cross_entropy(x, weight, bias, labels, *, chunk_rows=256) / causal_lm_loss(...)   (LM head, no logits kept)
    embedding_sparse_grad(ids, weight) / tied_uses(weight)   (a tied embedding: one vocabulary-sized gradient, not two)
    fused_attention(q, k, v, ...)  PyTorch's fused kernel, Q/K/V saved 8-bit (slimfit/autograd/fused_attention.py)

Each compressing function takes its options as keywords or as one frozen, once-checked object
(`options=`): LinearOptions, SampledLinearOptions, GELUOptions, SiLUOptions, SwiGLUOptions,
LayerNormOptions, RMSNormOptions, MatmulOptions, AttentionOptions, FusedAttentionOptions, DropoutOptions,
LinearCrossEntropyOptions; the autograd Function gets that object (slimfit.patching's options are or
hold them).

See docs/autograd.md for what each saves and the measured gradient errors.
"""
from ._norm import LayerNormOptions, RMSNormOptions
from .attention import AttentionOptions, attention
from .conv import conv
from .dropout import DropoutOptions, dropout
from .fused_attention import FusedAttentionOptions, fused_attention
from .geglu import GeGLUOptions, geglu
from .gelu import GELUOptions, gelu
from .grouped_linear import grouped_linear
from .layer_scale import LayerScaleOptions, layer_scale
from .layernorm import layer_norm
from .linear import LinearOptions, linear
from .linear_cross_entropy import LinearCrossEntropyOptions, causal_lm_loss, linear_cross_entropy
from .matmul import MatmulOptions, matmul
from .rmsnorm import rms_norm
from .row_scale import RowScaleOptions, row_scale
from .sampled_linear import SampledLinearOptions
from .silu import SiLUOptions, SwiGLUOptions, silu, swiglu

__all__ = ["attention", "conv", "dropout", "fused_attention", "gelu", "layer_norm", "linear", "matmul", "rms_norm",
           "silu", "swiglu", "geglu", "GeGLUOptions", "grouped_linear", "layer_scale", "LayerScaleOptions", "row_scale",
           "RowScaleOptions"]
__all__ += ["causal_lm_loss", "linear_cross_entropy"]
__all__ += ["AttentionOptions", "DropoutOptions", "FusedAttentionOptions", "GELUOptions", "LayerNormOptions",
            "LinearCrossEntropyOptions", "LinearOptions", "MatmulOptions", "RMSNormOptions", "SampledLinearOptions",
            "SiLUOptions", "SwiGLUOptions"]
