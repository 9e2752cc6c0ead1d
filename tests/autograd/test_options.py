"""One options object from keywords (or the patch) to the autograd Function (issue #29, item 4).

Each compressing function takes its options as keywords or as one frozen object (`options=`), checked
once when built; the object reaches the Function as it is. Built from keywords or handed over, the
outputs and gradients are the same bits; a handed-over object is not checked again; a keyword that
contradicts it is an error. The patch's options are (or hold) these objects.
"""
import dataclasses
import importlib
import inspect

import pytest
import torch
import torch._dynamo
from _grad_utils import single_thread  # noqa: F401  (autouse fixture)

from slimfit import SlimFitConfig
from slimfit import autograd as A
from slimfit.autograd.attention import _AttentionFn
from slimfit.autograd.fused_attention import _FusedAttentionFn
from slimfit.autograd.gelu import _GELU
from slimfit.autograd.layernorm import _LayerNorm
from slimfit.autograd.linear import _Linear
from slimfit.autograd.matmul import _Matmul
from slimfit.autograd.rmsnorm import _RMSNorm
from slimfit.autograd.sampled_linear import _SampledLinear, sampled_linear
from slimfit.autograd.seeds import reset_side_seeds
from slimfit.autograd.silu import _SiLU, _SwiGLU
from slimfit.patching import options as patch_options

gelu_module = importlib.import_module("slimfit.autograd.gelu")  # the attribute `gelu` is the function

# (public function, its options class, the keywords its options replace)
WRAPPERS = [
    (A.linear, A.LinearOptions), (sampled_linear, A.SampledLinearOptions), (A.gelu, A.GELUOptions),
    (A.silu, A.SiLUOptions), (A.swiglu, A.SwiGLUOptions), (A.layer_norm, A.LayerNormOptions),
    (A.rms_norm, A.RMSNormOptions), (A.matmul, A.MatmulOptions), (A.attention, A.AttentionOptions),
    (A.fused_attention, A.FusedAttentionOptions), (A.dropout, A.DropoutOptions),
    (A.linear_cross_entropy, A.LinearCrossEntropyOptions), (A.causal_lm_loss, A.LinearCrossEntropyOptions),
]


def _fields(cls):
    return {f.name: f.default for f in dataclasses.fields(cls) if f.init}


@pytest.mark.parametrize("fn, cls", WRAPPERS, ids=lambda v: getattr(v, "__name__", ""))
def test_keywords_are_the_fields_with_the_same_defaults(fn, cls):
    params = inspect.signature(fn).parameters
    assert params["options"].default is None and params["options"].kind is inspect.Parameter.KEYWORD_ONLY
    for name, default in _fields(cls).items():
        assert params[name].default == default and type(params[name].default) is type(default), name


@pytest.mark.parametrize("fn", [_Linear, _SampledLinear, _GELU, _SiLU, _SwiGLU, _LayerNorm, _RMSNorm, _Matmul,
                                _AttentionFn, _FusedAttentionFn])
def test_functions_take_one_options_object(fn):
    names = list(inspect.signature(fn.forward).parameters)
    assert "options" in names and len(names) <= 10, names
    assert not {"bits", "group_size", "stochastic", "check_finite", "keep_ratio"} & set(names)


def _grads(fn, *tensors, seed=0):
    torch.manual_seed(seed)
    reset_side_seeds()
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return [out.detach()] + [t.grad for t in leaves]


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


g = torch.Generator().manual_seed(0)
X = torch.randn(3, 5, 64, generator=g)
W = torch.randn(16, 64, generator=g)
V = torch.randn(64, generator=g) + 1
Q = torch.randn(2, 2, 8, 16, generator=g)

CASES = [
    ("linear", lambda o: lambda x, w: A.linear(x, w, **o), A.LinearOptions,
     dict(input_bits=4, group_size=32, stochastic=True), (X, W)),
    ("gelu", lambda o: lambda x: A.gelu(x, **o), A.GELUOptions, dict(bits=2, approximate="tanh", stochastic=True),
     (X,)),
    ("silu", lambda o: lambda x: A.silu(x, **o), A.SiLUOptions, dict(bits=8, group_size=64), (X,)),
    ("swiglu", lambda o: lambda a, b: A.swiglu(a, b, **o), A.SwiGLUOptions, dict(bits=4, up_bits=8), (X, X * 2)),
    ("layer_norm", lambda o: lambda x, w: A.layer_norm(x, (64,), w, **o), A.LayerNormOptions,
     dict(save="topk", keep_ratio=0.2), (X, V)),
    ("rms_norm", lambda o: lambda x, w: A.rms_norm(x, w, **o), A.RMSNormOptions, dict(save="int8", stochastic=True),
     (X, V)),
    ("matmul", lambda o: lambda a, b: A.matmul(a, b, **o), A.MatmulOptions, dict(a_bits=8, b_bits=2), (X, W.t())),
    ("attention", lambda o: lambda q, k, v: A.attention(q, k, v, **o), A.AttentionOptions,
     dict(qkv_bits=4, probs="int8"), (Q, Q * 0.5, Q + 1)),
    ("fused_attention", lambda o: lambda q, k, v: A.fused_attention(q, k, v, is_causal=True, **o),
     A.FusedAttentionOptions, dict(qkv_bits=8, backward="saved"), (Q, Q * 0.5, Q + 1)),
    ("sampled_linear", lambda o: lambda x, w: sampled_linear(x, w, generator_seed=3, **o), A.SampledLinearOptions,
     dict(ratio=0.4, k_min=2, input_bits=8), (X, W)),
    ("dropout", lambda o: lambda x: A.dropout(x, 0.3, seed=5, **o), A.DropoutOptions, dict(mode="bitmask"), (X,)),
]


@pytest.mark.parametrize("name, make, cls, keywords, tensors", CASES, ids=[c[0] for c in CASES])
def test_options_object_gives_the_bits_the_keywords_give(name, make, cls, keywords, tensors):
    by_keywords = _grads(make(keywords), *tensors)
    options = cls(**keywords)
    _same(by_keywords, _grads(make({"options": options}), *tensors))
    # a keyword beside options: left at its default or agreeing with it, fine; contradicting it, an error
    first, value = next(iter(keywords.items()))
    _same(by_keywords, _grads(make({"options": options, first: value}), *tensors))
    default = _fields(cls)[first]
    other = next(v for v in (8, 4, 2, "full", "int4", "none", "seed", 0.5) if type(v) is type(value)
                 and v not in (value, default))
    with pytest.raises(TypeError, match=f"{first}={other!r} contradicts options.{first}"):
        make({"options": options, first: other})(*tensors)


def test_a_handed_over_object_is_not_checked_again(monkeypatch):
    calls = []
    check_bits = gelu_module.check_bits
    monkeypatch.setattr(gelu_module, "check_bits", lambda *a, **k: calls.append(a) or check_bits(*a, **k))
    x = X.clone().requires_grad_()
    options = A.GELUOptions(bits=4)
    assert len(calls) == 1
    for _ in range(3):
        A.gelu(x, options=options).sum().backward()
    assert len(calls) == 1  # checked when built, not per call
    A.gelu(x, bits=4).sum().backward()
    assert len(calls) == 2  # keywords: checked once per call


def test_options_are_frozen_and_checked_with_the_messages_of_the_keywords():
    with pytest.raises(dataclasses.FrozenInstanceError):
        A.GELUOptions().bits = 8
    with pytest.raises(ValueError, match="slimfit.gelu: bits must be one of"):
        A.GELUOptions(bits=3)
    with pytest.raises(ValueError, match="slimfit.rms_norm: save must be one of"):
        A.rms_norm(X, save="int4")
    with pytest.raises(ValueError, match="slimfit.layer_norm: save must be one of"):
        A.LayerNormOptions(save="int4")
    with pytest.raises(ValueError, match="slimfit.swiglu: up_bits must be one of"):
        A.SwiGLUOptions(up_bits=3)
    with pytest.raises(TypeError, match="slimfit.sampled_linear: stochastic must be True or False"):
        A.SampledLinearOptions(stochastic="no")
    with pytest.raises(TypeError, match="slimfit.gelu: options must be a GELUOptions, got SiLUOptions"):
        A.gelu(X, options=A.SiLUOptions())
    assert A.SwiGLUOptions(bits=2).saved_up_bits == 2 and A.AttentionOptions(keep_ratio=1).keep_ratio == 1.0


def test_rms_norm_takes_layer_norm_options():
    """The two norms save x̂ alike: a LayerNormOptions (what the patch holds for both) serves rms_norm."""
    _same(_grads(lambda x, w: A.rms_norm(x, w, save="topk"), X, V),
          _grads(lambda x, w: A.rms_norm(x, w, options=A.LayerNormOptions(save="topk")), X, V))


def test_the_patch_options_are_the_autograd_options():
    config = SlimFitConfig.paper().with_sampling(method="wta_crs")
    linear = patch_options.LinearOptions.from_config(config, 8, patch_options.Sampling("wta_crs", 0.3, 4, None, "fc"))
    assert isinstance(linear, A.LinearOptions) and linear.sampled == A.SampledLinearOptions(
        input_bits=8, group_size=config.group_size, stochastic=config.stochastic, ratio=0.3, k_min=4)
    assert isinstance(patch_options.GELUOptions.from_config(config, "tanh"), A.GELUOptions)
    activation = patch_options.ActivationOptions.from_config(config)
    assert isinstance(activation, A.SwiGLUOptions) and isinstance(activation, A.SiLUOptions)
    norm = patch_options.NormOptions.from_config(config)
    assert norm.kernel(True) == A.LayerNormOptions(save=config.layernorm, keep_ratio=config.experimental.keep_ratio,
                                                   group_size=config.group_size)
    assert norm.kernel(False).save == config.layernorm_frozen
    topk = patch_options.NormOptions.from_config(config.with_experimental(topk_norms="frozen", keep_ratio=0.3))
    assert topk.kernel(False) == A.LayerNormOptions(save="topk", keep_ratio=0.3, group_size=config.group_size)
    assert topk.kernel(True).save == config.layernorm
    assert dataclasses.replace(norm, weight_offset=1.0).kernel(False) == norm.kernel(False)
    attention = patch_options.AttentionOptions.from_config(config)
    assert attention.materialize.probs == config.attention.probs
    experimental = config.with_experimental(topk_probs=True, dropout_on_v=True)
    probs_topk = patch_options.AttentionOptions.from_config(experimental)
    assert probs_topk.materialize.probs == "topk" and probs_topk.materialize.dropout_mode == "on_v"
    assert attention.fused.qkv_bits == config.attention.qkv_bits
    assert isinstance(patch_options.DropoutOptions.from_config(config), A.DropoutOptions)


def test_options_objects_compile_without_graph_breaks():
    torch._dynamo.reset()
    gelu_options, norm_options = A.GELUOptions(bits=4), A.LayerNormOptions(save="int8")

    def block(x, w):
        h = A.gelu(A.linear(x, w, options=A.LinearOptions(input_bits=8)), options=gelu_options)
        return A.layer_norm(h, (16,), options=norm_options)

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    try:
        _same(_grads(block, X, W), _grads(compiled, X, W))
    finally:
        torch._dynamo.reset()
