"""Forward mixins that patching swaps in by assigning `module.__class__`.

`patched_class(original, mixin)` builds (once) a subclass of the module's own class with
the mixin's forward first in the MRO, so parameters, buffers, state_dict keys and
isinstance checks stay as they were; unpatching assigns the original class back.
Per-module options live in the instance attribute `_slimfit` (a frozen dataclass of
`slimfit.patching.options`: LinearOptions, GELUOptions, ...), each one the slimfit.autograd options
object of the function the forward calls, or holding it: the forwards pass it down as `options=`, so
nothing is re-spread into keywords or checked again per call. When no gradient is needed (eval,
torch.no_grad) the original forward runs, so inference outputs are bit-identical to the unpatched model.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import autograd
from ..autograd.conv import conv
from ..autograd.geglu import geglu
from ..autograd.layer_scale import layer_scale
from ..autograd.relu import relu
from ..autograd.rmsnorm import rms_norm
from ..autograd.sampled_linear import sampled_linear
from ..autograd.silu import silu, swiglu
from .structure import fused_gated_names

ORIGINAL_CLASS = "_slimfit_original_class"
OPTIONS = "_slimfit"
NORM_CACHE = "_slimfit_norm_cache"  # a sampled linear's NormCache (sampling.py)


_CLASSES: dict = {}


def patched_class(original: type, mixin: type) -> type:
    """The subclass `SlimFit<Original>` of `original` with `mixin`'s forward, cached.

    Its instances pickle as (original class, mixin) plus their state (`__reduce_ex__`): the class is
    rebuilt on loading, so a pickled patched model loads in a process that never patched."""
    key = (original, mixin)
    if key not in _CLASSES:
        name = f"SlimFit{original.__name__}"
        cls = type(name, (mixin, original), {"__module__": __name__, "__qualname__": name,
                                             "__reduce_ex__": _reduce_ex})
        _CLASSES[key] = cls
    return _CLASSES[key]


def swap(module: nn.Module, mixin: type, options) -> None:
    """Patch one module: its class becomes patched_class(its class, mixin), `options` its OPTIONS."""
    original = type(module)
    setattr(module, ORIGINAL_CLASS, original)
    setattr(module, OPTIONS, options)
    module.__class__ = patched_class(original, mixin)


def unswap(module: nn.Module) -> None:
    """Undo `swap` on one module: its own class back, the options dropped."""
    module.__class__ = vars(module)[ORIGINAL_CLASS]
    delattr(module, ORIGINAL_CLASS)
    delattr(module, OPTIONS)


def _reduce_ex(self, protocol):
    cls = type(self)
    mixin, original = cls.__bases__
    # the original class's own reduction (nn.Module: copyreg.__newobj__, (cls,), state), with the
    # dynamically made class replaced by the recipe that rebuilds it
    reduction = super(cls, self).__reduce_ex__(max(int(protocol), 2))
    if not (isinstance(reduction, tuple) and len(reduction) >= 2 and reduction[1] and reduction[1][0] is cls):
        raise TypeError(f"slimfit: cannot pickle a patched {original.__name__} (its reduction is {reduction[0]!r})")
    return (_rebuild, (original, mixin) + tuple(reduction[1][1:])) + tuple(reduction[2:])


def _rebuild(original: type, mixin: type, *args):
    """Unpickling: the patched class of (original, mixin), made anew in this process."""
    cls = patched_class(original, mixin)
    return cls.__new__(cls, *args)


def _needs_grad(module: nn.Module, x: torch.Tensor) -> bool:
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or any(p.requires_grad for p in module.parameters(recurse=False))


def _original_forward(module: nn.Module, *args):
    return getattr(module, ORIGINAL_CLASS).forward(module, *args)


def _linear(module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """slimfit's linear, or its WTA-CRS sampled version when the layer is a sampling target and its
    weight trains (a frozen weight takes the frozen fast path either way)."""
    opts = getattr(module, OPTIONS)
    sampling = opts.sampling
    if sampling is not None and weight.requires_grad:
        ids = sampling.ids.for_input(x, sampling.name)
        return sampled_linear(x, weight, module.bias, sample_ids=ids,
                              norm_cache=getattr(module, NORM_CACHE) if ids is not None else None,
                              options=opts.sampled)
    return autograd.linear(x, weight, module.bias, options=opts)


class LinearMixin:
    """Frozen weight: saves nothing, no weight-gradient GEMM. Trainable: saves the input
    in full or quantized (LinearOptions.input_bits), or only sampled rows of it (LinearOptions.sampling)."""

    def forward(self, x):
        if not _needs_grad(self, x):
            return _original_forward(self, x)
        return _linear(self, x, self.weight)


class Conv1DMixin:
    """GPT-2's Conv1D (y = x @ W + b, W of shape (in, out)) through slimfit's linear."""

    def forward(self, x):
        if not _needs_grad(self, x):
            return _original_forward(self, x)
        return _linear(self, x, self.weight.t())


class GELUMixin:
    """Saves the GELU input quantized; backward uses the exact derivative at the dequantized input."""

    def forward(self, x):
        if not _needs_grad(self, x):
            return _original_forward(self, x)
        return autograd.gelu(x, options=getattr(self, OPTIONS))


class SiLUMixin:
    """Saves the SiLU input quantized; backward uses the exact derivative at the dequantized input."""

    def forward(self, x):
        if not _needs_grad(self, x):
            return _original_forward(self, x)
        return silu(x, options=getattr(self, OPTIONS))


class SwiGLUMixin:
    """A SwiGLU MLP (down_proj(act(gate_proj(x)) * up_proj(x)) with a SiLU activation: Llama, Mistral,
    Qwen2/3, OLMo ...) whose product silu(gate) * up saves gate and up quantized instead of three full tensors.
    The projections are called in the original order, so their own patches apply as usual."""

    def forward(self, x):
        if not torch.is_grad_enabled():
            return _original_forward(self, x)
        h = swiglu(self.gate_proj(x), self.up_proj(x), options=getattr(self, OPTIONS))
        return self.down_proj(h)


class GeGLUMixin:
    """A GeGLU MLP (down_proj(gelu(gate_proj(x)) * up_proj(x)): Gemma's GELU-tanh gate) whose product saves gate
    and up quantized instead of three full tensors (slimfit.autograd.geglu)."""

    def forward(self, x):
        if not torch.is_grad_enabled():
            return _original_forward(self, x)
        h = geglu(self.gate_proj(x), self.up_proj(x), options=getattr(self, OPTIONS))
        return self.down_proj(h)


def _fused_gated_forward(module, x, product):
    """down(dropout(product(gate, up))) of a fused gated MLP (structure.fused_gated_names: Phi-3's gate_up_proj,
    ModernBERT's Wi / drop / Wo)."""
    fused, down, dropout = fused_gated_names(module)
    gate, up = getattr(module, fused)(x).chunk(2, dim=-1)
    h = product(gate, up, options=getattr(module, OPTIONS))
    if dropout is not None:
        h = getattr(module, dropout)(h)
    return getattr(module, down)(h)


class FusedSwiGLUMixin:
    """A SwiGLU MLP whose gate and up projections are one linear ([gate, up] along the last dimension; Phi-3):
    down(silu(gate) * up), gate and up saved quantized as in SwiGLUMixin."""

    def forward(self, x):
        if not torch.is_grad_enabled():
            return _original_forward(self, x)
        return _fused_gated_forward(self, x, swiglu)


class FusedGeGLUMixin:
    """A GeGLU MLP whose gate and up projections are one linear (ModernBERT's Wi, GELU, dropout, Wo):
    down(dropout(gelu(gate) * up)), gate and up saved quantized as in GeGLUMixin."""

    def forward(self, x):
        if not torch.is_grad_enabled():
            return _original_forward(self, x)
        return _fused_gated_forward(self, x, geglu)


class RMSNormMixin:
    """RMSNorm (Llama's formula, or with the weight offset NormOptions names) saving x̂ (compressed by what
    the weight's requires_grad selects) and rstd."""

    def forward(self, x):
        if not _needs_grad(self, x):
            return _original_forward(self, x)
        opts = getattr(self, OPTIONS)
        kernel = opts.kernel(self.weight.requires_grad)
        # Gemma's (1 + w): the offset weight is a fresh (D,) tensor, its gradient the weight's
        weight = self.weight if opts.weight_offset == 0.0 else self.weight + opts.weight_offset
        return rms_norm(x, weight, getattr(self, opts.eps_attribute), options=kernel)


class LayerScaleMixin:
    """A per-channel scale x * w saving x quantized for w's gradient (slimfit.autograd.layer_scale)."""

    def forward(self, x):
        if not _needs_grad(self, x):
            return _original_forward(self, x)
        opts = getattr(self, OPTIONS)
        return layer_scale(x, getattr(self, opts.weight_attribute), options=opts)


class ReLUMixin:
    """nn.ReLU saving a 1-bit mask instead of its output (exact: slimfit.autograd.relu)."""

    def forward(self, x):
        if not _needs_grad(self, x):
            return _original_forward(self, x)
        return relu(x)


class ConvMixin:
    """nn.Conv1d/2d/3d: frozen weight -> nothing saved (slimfit.autograd.conv); trainable -> PyTorch's."""

    def forward(self, x):
        if not torch.is_grad_enabled() or self.weight.requires_grad:
            return _original_forward(self, x)
        padding = 0 if self.padding == "valid" else self.padding
        return conv(x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups)


class LayerNormMixin:
    """Saves x̂ and rstd only; x̂ compressed by what the weight's requires_grad selects."""

    def forward(self, x):
        if not _needs_grad(self, x):
            return _original_forward(self, x)
        kernel = getattr(self, OPTIONS).kernel(self.weight is not None and self.weight.requires_grad)
        return autograd.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, options=kernel)


class ParamFreeLayerNormMixin:
    """A LayerNorm without weight or bias (OLMo's), computed in fp32 and cast back as such norms do: saves x̂
    compressed as a frozen LayerNorm's and rstd; its epsilon is the one the patch-time probe found."""

    def forward(self, x):
        if not _needs_grad(self, x):
            return _original_forward(self, x)
        opts = getattr(self, OPTIONS)
        y = autograd.layer_norm(x.to(torch.float32), self.normalized_shape, None, None, opts.eps,
                                options=opts.kernel(False))
        return y if y.dtype == x.dtype else y.to(x.dtype)


class DropoutMixin:
    """Dropout whose mask is regenerated from a seed (0 bytes) or saved at 1 bit per element.

    In training the seeded mask is drawn even without a graph (torch.no_grad): reentrant gradient
    checkpointing runs its first pass that way and recomputes with gradients, and both passes must
    drop the same elements (the seed comes from torch's generator, whose state the recompute restores)."""

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return _original_forward(self, x)
        return autograd.dropout(x, self.p, True, options=getattr(self, OPTIONS))
