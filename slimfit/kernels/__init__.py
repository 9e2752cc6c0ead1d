"""Compression primitives (quantize, block-wise dynamic quantize, top-k, bit masks, seeded dropout).

Each op is declared once in `_ops.py` as `torch.ops.slimfit.<op>` with a pure-PyTorch
reference (`reference.py`), a C++ CPU kernel (csrc/) and a Triton CUDA kernel (`triton/`).
"""
from ._ops import SCHEMAS, backend_info
from .api import (
    BlockwiseTensor,
    PrunedTensor,
    QuantizedTensor,
    dequantize,
    dequantize_blockwise,
    dropout_mask,
    new_seed,
    pack_bits,
    quantize,
    quantize_blockwise,
    seeded_dropout,
    topk_prune,
    topk_restore,
    unpack_bits,
)

__all__ = [
    "SCHEMAS", "backend_info", "BlockwiseTensor", "quantize_blockwise", "dequantize_blockwise",
    "PrunedTensor", "QuantizedTensor", "dequantize", "dropout_mask",
    "new_seed", "pack_bits", "quantize", "seeded_dropout", "topk_prune", "topk_restore", "unpack_bits",
]
