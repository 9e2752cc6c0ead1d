"""The one registry of slimfit ops: schemas, fake (meta) kernels and backend registration.

Dispatch by device:
  CompositeExplicitAutograd  the pure-PyTorch reference (serves any device not claimed below)
  CPU                        the C++ kernels of the extension `slimfit._C` (registered from C++)
  CUDA                       CUDA kernels of the extension where built, Triton for the rest

SLIMFIT_BACKEND=reference forces the reference everywhere (the extension is not loaded and
no Triton kernel is registered); SLIMFIT_BACKEND=native requires the extension and Triton
(an error if they are missing); unset or `auto` uses what is available and warns once
when the extension is missing.
"""
from __future__ import annotations

import os

import torch

from . import reference
from .validation import num_groups, packed_code_bytes, topk_index_dtype

SCHEMAS = {
    "quantize": "quantize(Tensor x, int bits, int group_size, bool stochastic, int seed) -> (Tensor, Tensor, Tensor)",
    "dequantize": "dequantize(Tensor codes, Tensor scale, Tensor offset, int bits, int group_size, SymInt[] shape, ScalarType dtype) -> Tensor",
    "topk_prune": "topk_prune(Tensor x, int k, bool by_magnitude) -> (Tensor, Tensor)",
    "topk_restore": "topk_restore(Tensor values, Tensor indices, int row_length) -> Tensor",
    "pack_bits": "pack_bits(Tensor mask) -> Tensor",
    "unpack_bits": "unpack_bits(Tensor packed, int numel) -> Tensor",
    "dropout_mask": "dropout_mask(Tensor like, float p, int seed) -> Tensor",
    "seeded_dropout": "seeded_dropout(Tensor x, float p, int seed) -> Tensor",
}

_lib = torch.library.Library("slimfit", "DEF")
for _name, _schema in SCHEMAS.items():
    _lib.define(_schema)
    _lib.impl(_name, getattr(reference, _name), "CompositeExplicitAutograd")


@torch.library.register_fake("slimfit::quantize")
def _quantize_fake(x, bits, group_size, stochastic, seed):
    n = x.numel()
    ng = num_groups(n, group_size)
    return (
        x.new_empty(packed_code_bytes(n, bits), dtype=torch.uint8),
        x.new_empty(ng, dtype=torch.float32),
        x.new_empty(ng, dtype=torch.float32),
    )


@torch.library.register_fake("slimfit::dequantize")
def _dequantize_fake(codes, scale, offset, bits, group_size, shape, dtype):
    return codes.new_empty(tuple(shape), dtype=dtype)


@torch.library.register_fake("slimfit::topk_prune")
def _topk_prune_fake(x, k, by_magnitude):
    shape = tuple(x.shape[:-1]) + (k,)
    return x.new_empty(shape), x.new_empty(shape, dtype=topk_index_dtype(x.shape[-1]))


@torch.library.register_fake("slimfit::topk_restore")
def _topk_restore_fake(values, indices, row_length):
    return values.new_empty(tuple(values.shape[:-1]) + (row_length,))


@torch.library.register_fake("slimfit::pack_bits")
def _pack_bits_fake(mask):
    return mask.new_empty((mask.numel() + 7) // 8, dtype=torch.uint8)


@torch.library.register_fake("slimfit::unpack_bits")
def _unpack_bits_fake(packed, numel):
    return packed.new_empty(numel, dtype=torch.bool)


@torch.library.register_fake("slimfit::dropout_mask")
def _dropout_mask_fake(like, p, seed):
    return like.new_empty(like.shape, dtype=torch.bool)


@torch.library.register_fake("slimfit::seeded_dropout")
def _seeded_dropout_fake(x, p, seed):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ---------------------------------------------------------------- backends
BACKEND = os.environ.get("SLIMFIT_BACKEND", "auto").strip().lower() or "auto"
if BACKEND not in ("auto", "reference", "native"):
    raise ValueError(f"SLIMFIT_BACKEND must be 'auto', 'reference' or 'native', got {BACKEND!r}")

_state = {"native": None, "native_error": None, "triton": [], "triton_error": None, "cuda_ext": []}


def _has_kernel(name: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"slimfit::{name}", key)


def _load_native() -> None:
    from .. import _native

    ok, err = _native.load()
    _state["native"] = ok
    _state["native_error"] = err
    _state["cuda_ext"] = [n for n in SCHEMAS if _has_kernel(n, "CUDA")]
    if not ok and BACKEND == "native":
        raise ImportError(f"SLIMFIT_BACKEND=native but the extension slimfit._C could not be loaded: {err}")


def _register_triton() -> None:
    try:
        from . import triton as triton_kernels
    except Exception as exc:  # triton missing or too old
        _state["triton_error"] = f"{type(exc).__name__}: {exc}"
        if BACKEND == "native" and torch.cuda.is_available():
            raise
        return
    for name in SCHEMAS:
        if not _has_kernel(name, "CUDA") and hasattr(triton_kernels, name):
            _lib.impl(name, getattr(triton_kernels, name), "CUDA")
            _state["triton"].append(name)


if BACKEND != "reference":
    _load_native()
    if torch.cuda.is_available() or BACKEND == "native":
        _register_triton()


def backend_info() -> dict:
    """Which implementation serves each device, for `slimfit env` and bug reports."""
    return {
        "requested": BACKEND,
        "cpu": "native (C++)" if _state["native"] else "reference",
        "native_error": _state["native_error"],
        "cuda_extension_ops": list(_state["cuda_ext"]),
        "cuda_triton_ops": list(_state["triton"]),
        "triton_error": _state["triton_error"],
    }
