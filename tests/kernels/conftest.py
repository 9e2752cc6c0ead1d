"""Kernel tests: without CUDA, Triton kernels run on CPU tensors in the interpreter.

TRITON_INTERPRET must be set before `triton.jit` decorates the kernels (when
slimfit.kernels.triton is first imported), so it is set here, at collection time.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
