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
    eager = slimfit.patch(copy.deepcopy(model), SlimFitConfig.paper().with_attention(probs="int8"))
    compiled_src = slimfit.patch(copy.deepcopy(model), SlimFitConfig.paper().with_attention(probs="int8"))
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


@pytest.mark.slow
def test_regional_compile_with_the_scheduler_stops_compiling_and_matches_eager():
    """slimfit.compile under ILSScheduler: the frozen set changes every step, yet no graph is compiled
    after the first steps (whole-model torch.compile recompiles on each new frozen set), and the
    run (dropout on) equals eager under the same seeds."""
    from torch._dynamo.utils import counters

    from slimfit.scheduler import ILSScheduler

    def run(compiled: bool):
        model, inputs = build("bert")
        for m in model.modules():  # the attention core still draws an int seed (docs/autograd.md)
            if type(m).__name__ == "BertSelfAttention":
                m.dropout.p = 0.0
        slimfit.patch(model, SlimFitConfig.paper())
        if compiled:
            slimfit.compile(model, backend="aot_eager")
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = ILSScheduler(model, freeze_rate=0.5)
        sched.attach_optimizer(opt)
        torch.manual_seed(3)
        losses, graphs = [], []
        for _ in range(8):
            loss = model(**inputs).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(loss.item())
            graphs.append(counters["stats"]["unique_graphs"])
        return losses, graphs

    torch._dynamo.reset()
    counters.clear()
    compiled, graphs = run(True)
    eager, _ = run(False)
    assert graphs[4:] == [graphs[4]] * 4, graphs
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=1e-5)
