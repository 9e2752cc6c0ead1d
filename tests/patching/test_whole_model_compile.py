"""A patched Hugging Face model compiles whole: torch.compile(model, fullgraph=True) traces its forward and
backward with no graph break (the attention routing's bookkeeping runs at trace time, its argument binding is
plain dict steps), and the step equals eager's. Each new frozen set is a new graph (dynamo guards every
parameter's requires_grad); slimfit.compile is the form that does not recompile (tests/autograd/test_compile.py)."""
import inspect

import pytest
import torch

import slimfit
from slimfit.patching.attention.routes import _binder

from .tiny_models import build


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_a_patched_model_compiles_in_one_graph_and_steps_as_eager(family):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, inputs = build(family)[:2]
    if family == "llama":
        inputs = {**inputs, "labels": inputs["input_ids"]}
    slimfit.patch(model, slimfit.SlimFitConfig.paper())
    model.eval()   # no dropout: eager and compiled draw nothing
    for name, p in model.named_parameters():   # a frozen set, as the scheduler leaves one
        p.requires_grad_("layer.0" not in name and "layers.0" not in name)
    eager = model(**inputs).loss
    eager.backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = compiled(**inputs).loss
    got.backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
    have = _grads(model)
    assert have.keys() == want.keys() and len(want) > 0
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_binder_binds_as_inspect_does():
    def f(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        return None

    def g(module, query, key, value, *, is_causal=None):
        return None

    calls = [((1, 2, 3, 4), {}), ((1, 2), {"value": 3, "attention_mask": 4, "dropout": 0.1}),
             ((1, 2, 3, 4), {"softcap": 5.0, "sliding_window": 7}), ((1, 2, 3, 4), {"query": 9}),
             ((1, 2, 3, 4, 5, 6, 7), {}), ((1, 2, 3), {"is_causal": True}), ((1, 2, 3), {"unknown": 1})]
    for fn in (f, g):
        sig, bind = inspect.signature(fn), _binder(inspect.signature(fn))
        for args, kwargs in calls:
            try:
                bound = sig.bind("m", *args, **kwargs)
                want = dict(bound.arguments)
                want.update(want.pop("kwargs", {}))
            except TypeError:
                want = None
            got = bind("m", args, kwargs)
            if want is not None and got is not None:
                assert got == want, (fn.__name__, args, kwargs)
            else:
                # inspect refuses a call missing a required argument, which the original then refuses itself
                assert got is None or set(sig.parameters) - set(got) - {"kwargs"}, (fn.__name__, args, kwargs)
