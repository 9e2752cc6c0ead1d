"""torch.autograd.Functions that compute the forward exactly and save only compressed tensors.

    linear(x, weight, bias=None, *, input_bits=None, group_size=128, stochastic=False)
    gelu(x, *, bits=4, approximate='none', group_size=128, stochastic=False)
    layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, save='int8', keep_ratio=0.1, ...)
    rms_norm(x, weight=None, eps=1e-6, *, save='int8', keep_ratio=0.1, ...)     (LlamaRMSNorm, bit-exact)
    silu(x, *, bits=4, group_size=128, stochastic=False)
    swiglu(gate, up, *, bits=4, up_bits=None, group_size=128, stochastic=False)  (silu(gate) * up)
    conv(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1)      (frozen weight: 0 bytes)
    dropout(x, p=0.5, training=True, *, mode='seed', seed=None)
    matmul(a, b, *, a_bits=None, b_bits=None, group_size=128, stochastic=False)
    attention(...)  (slimfit/autograd/attention.py)
    linear_cross_entropy(x, weight, bias, labels, *, chunk_rows=256) / causal_lm_loss(...)   (LM head, no logits kept)
    fused_attention(q, k, v, ...)  PyTorch's fused kernel, Q/K/V saved 8-bit (slimfit/autograd/fused_attention.py)

See docs/autograd.md for what each saves and the measured gradient errors.
"""
from .attention import attention
from .conv import conv
from .dropout import dropout
from .fused_attention import fused_attention
from .gelu import gelu
from .layernorm import layer_norm
from .linear import linear
from .linear_cross_entropy import causal_lm_loss, linear_cross_entropy
from .matmul import matmul
from .rmsnorm import rms_norm
from .silu import silu, swiglu

__all__ = ["attention", "conv", "dropout", "fused_attention", "gelu", "layer_norm", "linear", "matmul", "rms_norm",
           "silu", "swiglu"]
__all__ += ["causal_lm_loss", "linear_cross_entropy"]
