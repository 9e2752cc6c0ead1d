"""Tiny models and loops shared by the tests of slimfit.optim (no downloads)."""
import torch
from torch import nn


class MLP(nn.Module):
    """Weight matrices of sizes that are not multiples of 128 (short last quantization groups)."""

    def __init__(self, d_in=24, d=200, depth=3, d_out=8, tied=False):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.norm = nn.LayerNorm(d)
        self.hidden = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.out = nn.Linear(d, d_out)
        self.tied = tied

    def forward(self, x):
        x = torch.relu(self.norm(self.inp(x)))
        for layer in self.hidden:
            x = torch.relu(layer(x))
        if self.tied:   # the first hidden weight used a second time: its gradient has two contributions
            x = torch.relu(x @ self.hidden[0].weight.t())
        return self.out(x)


def build(seed=0, **kwargs) -> MLP:
    torch.manual_seed(seed)
    return MLP(**kwargs)


def data(n=16, d_in=24, d_out=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


def loss_of(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def matrices(model) -> list:
    return [p for p in model.parameters() if p.dim() > 1]


def manual_schedule(model, step: int) -> None:
    """A frozen set that changes every step: matrix i trains when (i + step) % 3 != 0."""
    for i, p in enumerate(matrices(model)):
        p.requires_grad_((i + step) % 3 != 0)
        if not p.requires_grad:
            p.grad = None


def train(model, opt, batch, steps: int, schedule=manual_schedule, sched=None) -> None:
    """Plain loop: forward, backward, opt.step(), zero_grad, then the scheduler (or a manual frozen set)."""
    for s in range(steps):
        if sched is None and schedule is not None:
            schedule(model, s)
        loss_of(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()


def weights(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


def frozen_params(sched) -> list:
    """The scheduled parameters frozen right now (the scheduler's contract: requires_grad)."""
    return [p for p in sched.params if not p.requires_grad]


def plain_twin(model, opt, seed=0):
    """A plain AdamW on a copy of ``model`` whose moments are the held entries of ``opt`` decoded (the held
    step's reference: torch's step from the decoded values)."""
    from slimfit.optim import codec
    from slimfit.optim.keys import Q8

    ref = build(seed)
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for p, q in zip(model.parameters(), ref.parameters()):
        st = opt.state[p]
        ref_opt.state[q] = {"step": st["step"].clone(), "exp_avg": codec.decode(st["exp_avg" + Q8]),
                            "exp_avg_sq": codec.decode(st["exp_avg_sq" + Q8])}
    return ref, ref_opt
