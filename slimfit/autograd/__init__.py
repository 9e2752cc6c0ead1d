"""torch.autograd.Functions that compute the forward exactly and save only compressed tensors.

    linear(x, weight, bias=None, *, input_bits=None, group_size=128, stochastic=False)
    gelu(x, *, bits=4, approximate='none', group_size=128, stochastic=False)
    layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, save='int8', keep_ratio=0.1, ...)
    dropout(x, p=0.5, training=True, *, mode='seed', seed=None)
    matmul(a, b, *, a_bits=None, b_bits=None, group_size=128, stochastic=False)
    attention(...)  (slimfit/autograd/attention.py)

See docs/autograd.md for what each saves and the measured gradient errors.
"""
from .dropout import dropout
from .gelu import gelu
from .layernorm import layer_norm
from .linear import linear
from .matmul import matmul

__all__ = ["dropout", "gelu", "layer_norm", "linear", "matmul"]

try:
    from .attention import attention  # noqa: F401  (built in parallel; optional until it lands)
except ImportError:  # pragma: no cover
    pass
else:
    __all__.append("attention")
