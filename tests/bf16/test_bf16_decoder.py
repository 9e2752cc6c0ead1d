"""A decoder held in bf16 (``torch_dtype=torch.bfloat16``), patched: forward, loss and gradients against the
same model unpatched. exact() changes no arithmetic, so everything is bit-identical; paper() compresses what
backward reads, so its gradients are held to the compression error measured in fp32 plus bf16's own."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _bf16_decoder import SEQ, VOCAB, batch, build_decoder, clone

import slimfit
from slimfit.autograd import linear_cross_entropy


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _grads(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_exact_patch_is_bit_identical_in_bf16():
    model = build_decoder()
    ids = batch()
    patched = slimfit.patch(clone(model), slimfit.SlimFitConfig.exact())
    ref, g_ref = _grads(model, ids)
    got, g_got = _grads(patched, ids)
    assert got.logits.dtype == torch.bfloat16 and torch.equal(got.logits, ref.logits)
    assert torch.equal(got.loss, ref.loss)
    assert g_got.keys() == g_ref.keys() and len(g_ref) == len(list(model.parameters()))
    for name, g in g_ref.items():
        assert g_got[name].dtype == torch.bfloat16, name
        assert torch.equal(g_got[name], g), name


def test_paper_loss_is_the_chunked_loss_of_the_same_hidden_states():
    """paper() keeps no logits: its loss is slimfit's chunked cross-entropy of the final hidden states, which
    the compressed forward leaves bit-identical. It is that loss bit for bit; against transformers' loss it
    differs only in fp32 summation order."""
    model = build_decoder()
    ids = batch()
    patched = slimfit.patch(clone(model), slimfit.SlimFitConfig.paper())
    with torch.no_grad():
        ref = model(input_ids=ids, labels=ids, output_hidden_states=True)
        got = patched(input_ids=ids, labels=ids)
    hidden = ref.hidden_states[-1]
    chunked = linear_cross_entropy(hidden[:, :-1], model.lm_head.weight, None, ids[:, 1:])
    assert got.loss.dtype == torch.float32 and torch.equal(got.loss, chunked)
    # Two fp32 reductions of the same terms in different orders: a sum of m terms reordered moves by at most
    # 2(m - 1)·u32·Σ|terms| (u32 = 2**-24); the loss sums a log-sum-exp over VOCAB logits per token and the
    # mean over the tokens, so the relative difference stays below 2·(VOCAB + tokens)·2**-24.
    tokens = ids.shape[0] * (SEQ - 1)
    per_token = F.cross_entropy(ref.logits[:, :-1].float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1),
                                reduction="none")
    bound = 2 * (VOCAB + tokens) * 2.0 ** -24 * float(per_token.abs().mean())
    assert abs(float(got.loss) - float(ref.loss)) <= bound


def test_paper_gradients_within_compression_plus_bf16_error():
    """Per parameter, ||g_paper,bf16 − g_fp32|| / ||g_fp32|| ≤ e_comp + 2·e_bf16, where e_comp is paper()'s
    error in fp32 (the same compression, no bf16 rounding) and e_bf16 is PyTorch's own bf16 error on the
    unpatched model: flash-attention's rule (a low-precision kernel's error at most twice PyTorch's own)
    applied to the rounding, on top of the compression. Against the unpatched bf16 model the triangle
    inequality adds one more e_bf16."""
    ids = batch()
    fp32 = build_decoder(torch.float32)
    bf16 = clone(fp32).to(torch.bfloat16)
    _, g32 = _grads(fp32, ids)
    _, g16 = _grads(bf16, ids)
    _, gp32 = _grads(slimfit.patch(clone(fp32), slimfit.SlimFitConfig.paper()), ids)
    _, gp16 = _grads(slimfit.patch(clone(bf16), slimfit.SlimFitConfig.paper()), ids)
    assert gp16.keys() == g32.keys()
    for name, ref in g32.items():
        got = gp16[name]
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all(), name
        e_comp, e_bf = rel(gp32[name], ref), rel(g16[name], ref)
        assert rel(got, ref) <= e_comp + 2 * e_bf, name
        assert rel(got, g16[name]) <= e_comp + 3 * e_bf, name


@pytest.mark.parametrize("preset", ["exact", "paper"])
def test_patched_bf16_decoder_steps(preset):
    """Three AdamW steps (lr 1e-2: every update is above half a bf16 ulp of weights up to 1.0) move every
    parameter, keep everything finite and lower the loss."""
    model = slimfit.patch(build_decoder(), getattr(slimfit.SlimFitConfig, preset)())
    ids = batch()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.isfinite(p).all(), name
        assert not torch.equal(p, before[name]), name
