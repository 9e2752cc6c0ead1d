"""A tied head's weight gradient made at the end of backward (slimfit/autograd/head_grad_later.py): the same bits
as made at the loss, every parameter's gradient unchanged, and no vocabulary-sized gradient through the layers'
backward."""
import copy
import importlib

import pytest
import torch

from slimfit.memory import measure_step

transformers = pytest.importorskip("transformers")
lce = importlib.import_module("slimfit.autograd.linear_cross_entropy")   # the module (the package exports the function)

import slimfit  # noqa: E402
from slimfit import SlimFitConfig  # noqa: E402


def _tied_llama(vocab=97, hidden=32, layers=2, intermediate=64, dtype=torch.float32, chunk_rows=5):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=intermediate,
                                   max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().to(dtype)   # eval: no dropout, gradients still flow
    return slimfit.patch(model, SlimFitConfig(lm_head_chunk_rows=chunk_rows))


def _batch(vocab=97, batch=2, seq=24):
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[0, :5] = -100
    return {"input_ids": ids, "labels": labels}


def _at_the_loss(monkeypatch):
    """The head's weight gradient made at the loss, as without a HeadGradLater."""
    monkeypatch.setattr(lce, "head_grad_later_of", lambda weight: None)


def _step_grads(model, autocast=False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**_batch()).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float16, False), (torch.float32, True)])
def test_every_gradient_is_the_same_bits_as_made_at_the_loss(monkeypatch, dtype, autocast):
    model = _tied_llama(dtype=dtype)
    twin = copy.deepcopy(model)
    calls = []
    make = lce._weight_grad_later
    monkeypatch.setattr(lce, "_weight_grad_later", lambda *a: calls.append(1) or make(*a))
    loss, later = _step_grads(model, autocast)
    assert calls == [1]                                   # made later, once
    with monkeypatch.context() as m:
        _at_the_loss(m)
        twin_loss, at_loss = _step_grads(twin, autocast)
    assert torch.equal(loss, twin_loss)
    assert later.keys() == at_loss.keys() and "model.embed_tokens.weight" in later
    for name in at_loss:
        assert torch.equal(later[name], at_loss[name]), name
    assert later["model.embed_tokens.weight"].abs().sum() > 0


def test_an_fp32_head_keeps_its_one_pass(monkeypatch):
    """An fp32 head in fp32 sums its weight gradient in the input gradient's pass: nothing is left for later."""
    calls = []
    monkeypatch.setattr(lce, "_weight_grad_later", lambda *a: calls.append(1))
    _step_grads(_tied_llama())
    assert calls == []


def test_no_vocabulary_sized_gradient_through_the_layers_backward(monkeypatch):
    """A bf16 tied decoder: the head's gradient (2 MiB) is made after the layers' backward, so backward's peak is
    lower by most of its bytes (measured 0.80 of them: where the gradient is made at the end, its block sums
    come with it)."""
    vocab, hidden = 16384, 64
    model = _tied_llama(vocab, hidden, layers=2, intermediate=1024, dtype=torch.bfloat16, chunk_rows=16)
    twin = copy.deepcopy(model)
    batch = _batch(vocab, batch=2, seq=64)
    later = measure_step(model, batch)
    with monkeypatch.context() as m:
        _at_the_loss(m)
        at_loss = measure_step(twin, batch)
    head = vocab * hidden * 2
    drop = at_loss.phase_peaks["backward"] - later.phase_peaks["backward"]
    assert drop >= 0.75 * head, (drop, head)


def test_two_losses_on_one_head_both_reach_the_weight():
    """Each chunked loss on the tied head's alias keeps its part; the weight gets their sum, as made at the loss."""
    from slimfit.autograd import causal_lm_loss
    from slimfit.patching.tied_embedding import tied_weight_one_gradient

    def grads(model):
        batch = _batch()
        with tied_weight_one_gradient(model, model.get_output_embeddings().weight) as head:
            hidden = model.model(input_ids=batch["input_ids"]).last_hidden_state
        loss = causal_lm_loss(hidden, head, None, batch["labels"]) + 0.5 * causal_lm_loss(hidden, head, None,
                                                                                            batch["input_ids"])
        loss.backward()
        return model.get_input_embeddings().weight.grad.clone()

    model = _tied_llama(dtype=torch.bfloat16)
    twin = copy.deepcopy(model)
    later = grads(model)
    original = lce.head_grad_later_of
    lce.head_grad_later_of = lambda weight: None
    try:
        at_loss = grads(twin)
    finally:
        lce.head_grad_later_of = original
    assert torch.equal(later, at_loss)   # the two parts summed in the order autograd sums them
    assert later.abs().sum() > 0
