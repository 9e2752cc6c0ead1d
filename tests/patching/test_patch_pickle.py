"""A pickled patched model loads in a process that never patched (torch.save / torch.load of the
whole module, pickle, deepcopy): the patched classes are rebuilt from (original class, mixin)."""
import copy
import os
import pickle
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import slimfit  # noqa: E402
from slimfit import SlimFitConfig  # noqa: E402

from .tiny_models import build  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CHILD = """
import sys, torch
sys.path.insert(0, {tests!r})
model = torch.load({path!r}, weights_only=False)
from patching.tiny_models import build
_, inputs = build("bert")
model.train()
torch.manual_seed(3)
loss = model(**inputs).loss
loss.backward()
print(type(model.classifier).__name__, model.config._attn_implementation, repr(loss.item()))
print(repr(model.classifier.weight.grad.sum().item()))
import slimfit
slimfit.unpatch(model)
print(type(model.classifier).__name__, model.config._attn_implementation)
"""


_CHILD_PLAIN = """
import torch
model = torch.load({path!r}, weights_only=False)
x = torch.load({x!r})
model.train()
torch.manual_seed(3)
y = model(x)
y.pow(2).sum().backward()
print(type(model[0]).__name__, type(model[3]).__name__, repr(y.sum().item()), repr(model[0].weight.grad.sum().item()))
"""


def test_plain_model_loads_in_a_fresh_process(tmp_path):
    """A torch-only model (fast: no transformers import in the child)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Dropout(0.3))
    slimfit.patch(model, SlimFitConfig.paper())
    x = torch.randn(4, 8)
    path, xpath = str(tmp_path / "model.pt"), str(tmp_path / "x.pt")
    torch.save(model, path)
    torch.save(x, xpath)
    out = subprocess.run([sys.executable, "-c", _CHILD_PLAIN.format(path=path, x=xpath)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    model.train()
    torch.manual_seed(3)
    y = model(x)
    y.pow(2).sum().backward()
    expected = f"SlimFitLinear SlimFitDropout {y.sum().item()!r} {model[0].weight.grad.sum().item()!r}"
    assert out.stdout.strip() == expected


@pytest.mark.slow
def test_torch_save_loads_in_a_fresh_process(tmp_path):
    """A transformers model: the child must also find slimfit's attention implementation."""
    model, inputs = build("bert")
    slimfit.patch(model, SlimFitConfig.paper())
    path = str(tmp_path / "model.pt")
    torch.save(model, path)
    model.train()
    torch.manual_seed(3)
    loss = model(**inputs).loss
    loss.backward()
    out = subprocess.run([sys.executable, "-c", _CHILD.format(tests=os.path.join(ROOT, "tests"), path=path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == f"SlimFitLinear slimfit_sdpa {loss.item()!r}"
    assert float(lines[1]) == model.classifier.weight.grad.sum().item()
    assert lines[2] == "Linear sdpa"


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_pickle_and_deepcopy_keep_the_patch(protocol):
    model, inputs = build("bert")
    slimfit.patch(model, SlimFitConfig.wta_crs())  # sampling hooks on the root must pickle too
    for twin in (pickle.loads(pickle.dumps(model, protocol=protocol)), copy.deepcopy(model)):
        assert type(twin.classifier) is type(model.classifier)
        twin.eval()
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(twin(**inputs).logits, model(**inputs).logits, rtol=0, atol=0)
        slimfit.unpatch(twin)
        assert type(twin.classifier) is torch.nn.Linear
