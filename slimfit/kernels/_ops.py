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

import functools
import os

import torch

from . import reference
from .validation import OP_CHECKS, blockwise_bits, num_groups, packed_code_bytes, topk_index_dtype

SCHEMAS = {
    "quantize": "quantize(Tensor x, int bits, int group_size, bool stochastic, int seed) -> (Tensor, Tensor, Tensor)",
    "dequantize": "dequantize(Tensor codes, Tensor scale, Tensor offset, int bits, int group_size, SymInt[] shape, "
                  "ScalarType dtype) -> Tensor",
    "topk_prune": "topk_prune(Tensor x, int k, bool by_magnitude) -> (Tensor, Tensor)",
    "topk_restore": "topk_restore(Tensor values, Tensor indices, int row_length) -> Tensor",
    "pack_bits": "pack_bits(Tensor mask) -> Tensor",
    "unpack_bits": "unpack_bits(Tensor packed, int numel) -> Tensor",
    "dropout_mask": "dropout_mask(Tensor like, float p, int seed) -> Tensor",
    "seeded_dropout": "seeded_dropout(Tensor x, float p, int seed) -> Tensor",
    "quantize_blockwise": "quantize_blockwise(Tensor x, Tensor qmap, int block_size, bool stochastic=False, "
                          "int seed=0) -> (Tensor, Tensor)",
    "dequantize_blockwise": "dequantize_blockwise(Tensor codes, Tensor absmax, Tensor qmap, int block_size, "
                            "SymInt[] shape, ScalarType dtype) -> Tensor",
    "round_stochastic": "round_stochastic(Tensor x, ScalarType dtype, int seed) -> Tensor",
    "adam_blockwise_": "adam_blockwise_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] m_codes, "
                       "Tensor(c!)[] m_absmax, Tensor(d!)[] v_codes, Tensor(e!)[] v_absmax, Tensor qmap_m, "
                       "Tensor qmap_v, float[] step_sizes, float[] decays, float[] bc2_sqrts, float beta1, "
                       "float beta2, float eps, float weight_decay, bool decoupled, int block_size, "
                       "bool stochastic, int[] seeds, int[] offsets, bool round_weights, "
                       "Tensor(f!)[] score_sums, int score) -> ()",
}



def _checked(name: str, kernel):
    """`kernel` after the argument checks the C++ kernels make (validation.OP_CHECKS), so the Python
    backends (reference, Triton launchers) refuse what the native one refuses, with the same words."""
    check = OP_CHECKS[name]

    @functools.wraps(kernel)
    def checked(*args):
        check(*args)
        return kernel(*args)

    return checked


_lib = torch.library.Library("slimfit", "DEF")
for _name, _schema in SCHEMAS.items():
    _lib.define(_schema)
    _lib.impl(_name, _checked(_name, getattr(reference, _name)), "CompositeExplicitAutograd")


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


@torch.library.register_fake("slimfit::quantize_blockwise")
def _quantize_blockwise_fake(x, qmap, block_size, stochastic=False, seed=0):
    n = x.numel()
    return (x.new_empty(packed_code_bytes(n, blockwise_bits(qmap)), dtype=torch.uint8),
            x.new_empty(num_groups(n, block_size), dtype=torch.float32))


@torch.library.register_fake("slimfit::dequantize_blockwise")
def _dequantize_blockwise_fake(codes, absmax, qmap, block_size, shape, dtype):
    return codes.new_empty(tuple(shape), dtype=dtype)


@torch.library.register_fake("slimfit::round_stochastic")
def _round_stochastic_fake(x, dtype, seed):
    return x.new_empty(x.shape, dtype=dtype)


@torch.library.register_fake("slimfit::adam_blockwise_")
def _adam_blockwise_fake(*args):
    return None   # in place: nothing allocated


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


# ---------------------------------------------------------------- autograd
# seeded_dropout, topk_prune and topk_restore are linear in their float input: their gradients are
# the same op on the gradient. Quantization has no gradient: a graph through quantize / dequantize
# raises in backward instead of returning a gradient that silently misses this path.
ops = torch.ops.slimfit


def _dropout_setup(ctx, inputs, output):
    _, ctx.p, ctx.seed = inputs


def _dropout_backward(ctx, grad):
    return ops.seeded_dropout(grad.contiguous(), ctx.p, ctx.seed), None, None


def _prune_setup(ctx, inputs, output):
    x, _, _ = inputs
    ctx.row_length = x.shape[-1]
    ctx.save_for_backward(output[1])


def _prune_backward(ctx, grad_values, grad_indices):
    (indices,) = ctx.saved_tensors
    return ops.topk_restore(grad_values.contiguous(), indices, ctx.row_length), None, None


def _restore_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _restore_backward(ctx, grad):
    (indices,) = ctx.saved_tensors
    return torch.gather(grad, -1, indices.to(torch.int64)), None, None


def _nothing(ctx, inputs, output):
    pass


def _no_gradient(op: str):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"slimfit::{op} is not differentiable (rounding to codes has no gradient), but a gradient "
            f"reached it: detach its input (x.detach()) or use slimfit.autograd's functions, which save "
            "compressed activations and compute exact gradients themselves"
        )

    return backward


torch.library.register_autograd("slimfit::seeded_dropout", _dropout_backward, setup_context=_dropout_setup)
torch.library.register_autograd("slimfit::topk_prune", _prune_backward, setup_context=_prune_setup)
torch.library.register_autograd("slimfit::topk_restore", _restore_backward, setup_context=_restore_setup)
torch.library.register_autograd("slimfit::quantize", _no_gradient("quantize"), setup_context=_nothing)
torch.library.register_autograd("slimfit::dequantize", _no_gradient("dequantize"), setup_context=_nothing)
for _op in ("quantize_blockwise", "dequantize_blockwise", "round_stochastic"):
    torch.library.register_autograd(f"slimfit::{_op}", _no_gradient(_op), setup_context=_nothing)


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
            _lib.impl(name, _checked(name, getattr(triton_kernels, name)), "CUDA")
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
