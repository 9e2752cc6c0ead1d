"""PyTorch's own attention through slimfit's compressed paths: every call of
`F.scaled_dot_product_attention` made inside a patched model's forward.

That covers `nn.MultiheadAttention` when it runs without attention weights (`need_weights=False`, as
`nn.TransformerEncoderLayer` / `DecoderLayer` call it in training) and modules that call SDPA directly
(timm's ViTs, most hand-written transformers). The calls are caught by a `TorchFunctionMode` entered by a
forward pre-hook of the model and left by a forward hook (`always_call=True`, so an exception does not
leave it behind); no module is swapped. One exception to "thread-local": `F.multi_head_attention_forward`
is itself a torch function, and the mode is off while it handles one, so its inner SDPA call would not be
seen; for the duration of that one call the `scaled_dot_product_attention` global of torch.nn.functional
(which it calls by name) is rebound to a router that acts only on the calling thread and passes other
threads' calls through unchanged. Each call then takes the same
path rule as Hugging Face models (`hf_attention.choose_path`): PyTorch's fused kernel with Q/K/V saved at
8 bits where one exists, slimfit's materializing core otherwise (e.g. attention dropout on the CPU).
Calls that need no gradient, or that SDPA itself would refuse, run the original function.

Used for models whose attention is not a transformers attention slimfit routes through its registry.
`nn.MultiheadAttention` with `need_weights=True` (its default when called directly) computes softmax(QKᵀ)
itself, without SDPA, and is left as it is.
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ... import autograd
from ..options import AttentionOptions
from .hf_attention import choose_path

ROUTER = "_slimfit_sdpa_router"
_SDPA = F.scaled_dot_product_attention


def _original(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    extra = {"enable_gqa": True} if enable_gqa else {}
    return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                 **extra)


def route(opts: AttentionOptions, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    """One F.scaled_dot_product_attention call, through slimfit when it builds a graph."""
    return _route(opts, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)[0]


def _takes(query, key, value, attn_mask, is_causal, enable_gqa) -> bool:
    """Whether slimfit takes this call: it builds a graph, and SDPA would accept it as it is (SDPA answers
    broadcasting and its own errors itself)."""
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or any(t.dim() != 4 for t in tensors):
        return False
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    hq, hk = query.shape[1], key.shape[1]
    # one K/V head broadcasts over the query heads (multi-query models call SDPA that way): grouped
    # query attention with a single group
    shapes_ok = hq == hk or bool((enable_gqa or hk == 1) and hk and hq % hk == 0)
    return needs_grad and shapes_ok and not (attn_mask is not None and is_causal)


def _route(opts: AttentionOptions, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
           enable_gqa=False) -> tuple:
    """(output, whether slimfit's core computed it)."""
    if not _takes(query, key, value, attn_mask, is_causal, enable_gqa):
        return _original(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa), False
    return _slimfit_sdpa(opts, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa), True


def _slimfit_sdpa(opts, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    hq, hk = query.shape[1], key.shape[1]
    path, _ = choose_path(opts, query, key, value, attn_mask, float(dropout_p), bool(is_causal))
    if path == "fused":
        return autograd.fused_attention(query, key, value, scale=scale, attn_mask=attn_mask, is_causal=is_causal,
                                        dropout_p=dropout_p, training=True, options=opts.fused)
    if hq != hk:
        key, value = key.repeat_interleave(hq // hk, 1), value.repeat_interleave(hq // hk, 1)
    return autograd.attention(query, key, value, scale=scale, attn_mask=attn_mask, is_causal=is_causal,
                              dropout_p=dropout_p, training=True, options=opts.materialize)


_local = threading.local()  # the options of the MHA call running on this thread, if any
_lock = threading.Lock()
_rebound = 0


def _thread_router(*args, **kwargs):
    opts = getattr(_local, "opts", None)
    if opts is None:  # another thread's call while one thread is inside MHA: as PyTorch
        return _SDPA(*args, **kwargs)
    return route(opts, *args, **kwargs)


@contextlib.contextmanager
def _rebind_sdpa_global(opts: AttentionOptions):
    """F.scaled_dot_product_attention -> _thread_router while this thread runs one MHA call."""
    global _rebound
    previous = getattr(_local, "opts", None)
    _local.opts = opts
    with _lock:
        if _rebound == 0:
            F.scaled_dot_product_attention = _thread_router
        _rebound += 1
    try:
        yield
    finally:
        _local.opts = previous
        with _lock:
            _rebound -= 1
            if _rebound == 0:
                F.scaled_dot_product_attention = _SDPA


class _SDPARouter(TorchFunctionMode):
    def __init__(self, opts: AttentionOptions | dict, on_route=None):
        super().__init__()
        self.opts = AttentionOptions.of(opts)
        self.on_route = on_route  # called once per call slimfit's core computed
        self.routed = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:  # the mode is off while this runs, so slimfit's own calls are not caught
            out, taken = _route(self.opts, *args, **kwargs)
            if taken and not torch.compiler.is_compiling():
                self.routed += 1
                if self.on_route is not None:
                    self.on_route()
            return out
        if func is F.multi_head_attention_forward:  # calls SDPA by its global name, with the mode off
            with _rebind_sdpa_global(self.opts):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


_module_routers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def module_router(module: nn.Module, opts: AttentionOptions, on_route) -> _SDPARouter:
    """The mode that routes one module's own F.scaled_dot_product_attention calls while entered (made
    once per module and options, kept beside the module, not on it, so the module pickles as an unpatched one does;
    `on_route` is called for each call slimfit computed and must not hold the module strongly)."""
    mode = _module_routers.get(module)
    if mode is None or mode.opts != opts:
        mode = _SDPARouter(opts, on_route)
        _module_routers[module] = mode
    return mode


class _Router:
    """The mode and hook handles of one model (kept on the model, removed by `remove`)."""

    def __init__(self, model: nn.Module, opts: AttentionOptions):
        self.mode = _SDPARouter(opts)
        self.depth = 0
        self.handles = [model.register_forward_pre_hook(self._enter),
                        model.register_forward_hook(self._leave, always_call=True)]

    def _enter(self, module, args):
        if self.depth == 0:
            self.mode.__enter__()
        self.depth += 1

    def _leave(self, module, args, output):
        self.depth -= 1
        if self.depth == 0:
            self.mode.__exit__(None, None, None)


def install(model: nn.Module, config, summary) -> bool:
    """Route the model's F.scaled_dot_product_attention calls (config.attention must not be None)."""
    if hasattr(model, ROUTER):
        return True
    router = _Router(model, AttentionOptions.from_config(config))
    setattr(model, ROUTER, router)
    summary.sdpa_router = router
    summary.attention = "F.scaled_dot_product_attention"
    mode = f"qkv {config.attention.qkv_bits or 'full'}, path {config.attention.path}"
    mha = [name for name, module in model.named_modules() if isinstance(module, nn.MultiheadAttention)]
    for name in mha:
        summary.patched.append((name, "attention",
                                mode + " (F.scaled_dot_product_attention; need_weights=False calls)"))
    summary.patched.append(("<sdpa>", "attention", mode + ": every F.scaled_dot_product_attention call in forward"))
    return True


def remove(model: nn.Module) -> None:
    router = getattr(model, ROUTER, None)
    if router is None:
        return
    for handle in router.handles:
        handle.remove()
    delattr(model, ROUTER)
