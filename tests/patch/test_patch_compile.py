"""torch.compile of a patched model trains (slow: Inductor compiles C++ on the CPU)."""
import copy

import pytest
import torch

pytest.importorskip("transformers")

import slimfit  # noqa: E402
from slimfit import SlimFitConfig  # noqa: E402

from .tiny_models import build  # noqa: E402


@pytest.mark.slow
def test_compiled_patched_bert_trains_like_eager():
    model, inputs = build("bert")
    model.eval()  # no dropout: eager and compiled runs see the same computation
    eager = slimfit.patch(copy.deepcopy(model), SlimFitConfig.paper().replace(attn_probs="int8"))
    compiled_src = slimfit.patch(copy.deepcopy(model), SlimFitConfig.paper().replace(attn_probs="int8"))
    compiled = torch.compile(compiled_src)
    losses = {}
    for name, m, params in (("eager", eager, eager.parameters()), ("compiled", compiled, compiled_src.parameters())):
        opt = torch.optim.SGD(params, lr=0.05)
        losses[name] = []
        for _ in range(3):
            loss = m(**inputs).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    assert losses["compiled"][-1] < losses["compiled"][0]
    torch.testing.assert_close(torch.tensor(losses["compiled"]), torch.tensor(losses["eager"]), rtol=1e-4, atol=1e-5)
