"""Which parameters are layers, and the errors for inputs that cannot work."""
import pytest
import torch
from _models import MLP
from torch import nn

from slimfit.scheduler import ILSScheduler, find_candidates


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 4))
        self.norm = RMSNorm(4)
        self.scale = nn.Parameter(torch.ones(4))          # 1-D, not a norm: never a layer
        self.proj = nn.Linear(4, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight                   # tied


def test_mlp_candidates_no_biases():
    assert [n for n, _ in find_candidates(MLP())] == [
        "fc1.weight", "ln1.weight", "fc2.weight", "ln2.weight", "head.weight"]


def test_norm_like_embeddings_tied_and_cls_token():
    got = [n for n, _ in find_candidates(Odd())]
    assert got == ["cls_token", "emb.weight", "norm.weight", "proj.weight"]


def test_named_parameter_input_and_heuristic():
    m = MLP()
    assert [n for n, _ in find_candidates(m.named_parameters())] == [
        "fc1.weight", "ln1.weight", "fc2.weight", "ln2.weight", "head.weight"]
    s = ILSScheduler(Odd().named_parameters(), freeze_rate=0.5, scheduled_kinds="all")
    assert s.names == ["cls_token", "emb.weight", "norm.weight", "proj.weight"]
    # By default the class token (an embedding by its name) and the norm weight train every step; "emb"
    # is tied to a Linear in Odd, and by name alone it does not read as an embedding table either.
    assert ILSScheduler(Odd().named_parameters(), freeze_rate=0.5).names == ["emb.weight", "proj.weight"]


def test_frozen_at_start_are_left_alone():
    m = MLP()
    m.fc1.weight.requires_grad_(False)                   # e.g. a LoRA base weight
    s = ILSScheduler(m, freeze_rate=0.0)
    assert "fc1.weight" not in s.names and not m.fc1.weight.requires_grad


def test_errors():
    with pytest.raises(ValueError, match="no candidate layers"):
        ILSScheduler(nn.Sequential(nn.ReLU()))
    bias_only = nn.Module()
    bias_only.bias = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="no candidate layers"):
        ILSScheduler(bias_only)
    m = MLP()
    with pytest.raises(TypeError, match="named_parameters"):
        ILSScheduler(m.parameters())
    for rate in (-0.1, 1.0, 2):
        with pytest.raises(ValueError, match=r"freeze_rate must be in \[0, 1\)"):
            ILSScheduler(m, freeze_rate=rate)
    with pytest.raises(ValueError, match="score must be"):
        ILSScheduler(m, score="l2")
    with pytest.raises(ValueError, match="min_trained_steps"):
        ILSScheduler(m, min_trained_steps=-1)
    # an explicit layer list that does not match the model
    with pytest.raises(ValueError, match="not a parameter of MLP"):
        ILSScheduler(m, layers=["fc1.weight", "fc9.weight"])
    other = MLP()
    with pytest.raises(ValueError, match="does not match the model"):
        ILSScheduler(m, layers=[("fc1.weight", other.fc1.weight)])
    with pytest.raises(ValueError, match="appears twice"):
        ILSScheduler([("a", m.fc1.weight), ("a", m.fc2.weight)])
    ok = ILSScheduler(m, layers=["fc1.weight", ("fc2.weight", m.fc2.weight)], freeze_rate=0.5)
    assert ok.names == ["fc1.weight", "fc2.weight"]


def test_state_from_another_model_is_rejected():
    s = ILSScheduler(MLP(), freeze_rate=0.5)
    sd = s.state_dict()
    other = ILSScheduler(Odd(), freeze_rate=0.5)
    with pytest.raises(ValueError, match="does not match this model"):
        other.load_state_dict(sd)
    bigger = ILSScheduler(MLP(d=16), freeze_rate=0.5)
    with pytest.raises(ValueError, match="different shapes"):
        bigger.load_state_dict(sd)


def test_always_train_keeps_the_head_out_of_scheduling():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    sched = ILSScheduler(model, freeze_rate=0.9, always_train=["4"], warmup_steps=0)
    assert sched.names == ["0.weight", "2.weight"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched.attach_optimizer(opt)
    for _ in range(5):
        assert model[4].weight.requires_grad  # the head trains every step, whatever is frozen
        assert sched.num_frozen == 1  # round(0.9 * 2) of the two scheduled layers
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def test_always_train_names_must_match_a_layer():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    with pytest.raises(ValueError, match="'classifier' matches none"):
        ILSScheduler(model, always_train=["classifier"])
    with pytest.raises(ValueError, match="nothing is left to schedule"):
        ILSScheduler(model, always_train=["0", "1"])
    # a prefix is a module name, not a string prefix: "1" does not cover "10.weight"
    assert ILSScheduler(nn.Sequential(*[nn.Linear(2, 2) for _ in range(11)]), always_train="1").names[-1] == "10.weight"
