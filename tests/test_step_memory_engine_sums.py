"""Autograd's own sum of two gradients of one tensor (a tied embedding and LM head): in place without a dispatch
mode, out of place under one. slimfit.step_memory's tracker is a dispatch mode, and counts the step as a run
without it: the sum as the freed summand's storage continuing."""
import importlib

import torch

from slimfit.memory import measure_step

lce = importlib.import_module("slimfit.autograd.linear_cross_entropy")
V, H, ROWS = 8192, 128, 256


class TiedDecoderHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, H)

    def forward(self, ids):
        return lce.causal_lm_loss(self.emb(ids), self.emb.weight, None, ids, chunk_rows=32)


def _ids():
    return torch.randint(0, V, (1, ROWS), generator=torch.Generator().manual_seed(1))


def test_without_a_mode_torch_sums_into_the_heads_gradient(monkeypatch):
    """What the tracker models: the plain run's .grad is the head's gradient tensor itself (in place)."""
    made = []
    one_pass = lce._one_pass

    def recording(*args):
        out = one_pass(*args)
        made.append(out[2].data_ptr())   # the address only: a reference would make torch sum out of place
        return out

    monkeypatch.setattr(lce, "_one_pass", recording)
    model = TiedDecoderHead()
    model(_ids()).backward()
    assert len(made) == 1 and model.emb.weight.grad.data_ptr() == made[0]


def test_the_step_peak_counts_the_tied_sum_in_place():
    """Backward holds the head's gradient and the embedding's; a third tensor of their size (the sum made out of
    place under the tracker) is not counted."""
    model = TiedDecoderHead()
    run = measure_step(model, (_ids(),))
    weight = V * H * 4
    chunk = 32 * V * 4
    assert 2 * weight <= run.total - run.resident <= 2 * weight + 4 * chunk, (run.total - run.resident, weight)


class TiedLinearHead(torch.nn.Module):
    """A tied head as transformers builds it: nn.Linear on 3-d hidden states, whose weight gradient reaches
    autograd's sum as a view (of the matrix product's output)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, H)
        self.head = torch.nn.Linear(H, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return torch.nn.functional.cross_entropy(self.head(self.emb(ids)).view(-1, V), ids.view(-1))


def test_the_step_peak_counts_a_view_summand_as_a_third_tensor():
    """The head's gradient reaches the sum as a view, which torch does not take over: the sum is a third
    tensor (peak RSS of a bf16 128256 x 2048 tied head in backward: three head sizes; untied: two)."""
    model = TiedLinearHead()
    run = measure_step(model, (_ids()[:, :8],))
    weight = V * H * 4
    assert 3 * weight <= run.total - run.resident <= 3 * weight + 2 * 8 * V * 4, (run.total - run.resident, weight)
