"""Triton kernels of every slimfit op.

`slimfit.kernels._ops` registers each launcher below, by name, as the CUDA kernel of
`torch.ops.slimfit.<op>`; the launchers take the same positional arguments and return
the same outputs as `slimfit.kernels.reference`, bit for bit. They also run on CPU
tensors under `TRITON_INTERPRET=1` (how the tests exercise them without a GPU).
"""
from .adam_blockwise import adam_blockwise_
from .bits import pack_bits, unpack_bits
from .dropout import dropout_mask, seeded_dropout
from .quantize import dequantize, quantize
from .quantize_blockwise import dequantize_blockwise, quantize_blockwise
from .round_stochastic import round_stochastic
from .topk import topk_prune, topk_restore

__all__ = [
    "quantize", "dequantize", "topk_prune", "topk_restore",
    "pack_bits", "unpack_bits", "dropout_mask", "seeded_dropout", "quantize_blockwise", "dequantize_blockwise",
    "round_stochastic", "adam_blockwise_",
]
