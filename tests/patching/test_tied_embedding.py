"""A tied input embedding's sparse gradient (slimfit.autograd.sparse_embedding, slimfit.patching.tied_embedding):
the summed gradient bit-identical to PyTorch's dense one in fp32 and nearer an fp64 sum in bf16, the parameter's
.grad always dense, one vocabulary-sized gradient fewer at the step's peak, and only where it is exact."""
import copy

import pytest
import torch
import torch.nn.functional as F

from slimfit.autograd.sparse_embedding import embedding_sparse_grad
from slimfit.memory import measure_step
from slimfit.patching.tied_embedding import TIED_EMBEDDING, tied_weight_one_gradient, unpatch_tied_embedding

transformers = pytest.importorskip("transformers")

import slimfit  # noqa: E402
from slimfit import SlimFitConfig  # noqa: E402

V, H = 50, 16


def _summed_grad(lookup, dtype, ids, padding_idx=None):
    """The weight's gradient with a dense head-like gradient summed first, as in a tied causal LM."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(V, H, generator=gen).to(dtype).requires_grad_()
    gout = (torch.randn(*ids.shape, H, generator=gen) * 1e-2).to(dtype)
    head = (torch.randn(V, H, generator=gen) * 1e-1).to(dtype)
    ((lookup(ids, w, padding_idx) * gout).sum() + (w * head).sum()).backward()
    return w.grad


@pytest.mark.parametrize("padding_idx", [None, 3, -1])
def test_fp32_sum_is_bit_identical_to_the_dense_lookup(padding_idx):
    ids = torch.randint(0, 6, (4, 64), generator=torch.Generator().manual_seed(1))
    ids[0, 0] = V - 1  # the padding row under -1
    dense = _summed_grad(F.embedding, torch.float32, ids, padding_idx)
    sparse = _summed_grad(embedding_sparse_grad, torch.float32, ids, padding_idx)
    assert sparse.layout == torch.strided and torch.equal(sparse, dense)


def test_bf16_rows_are_summed_in_fp32_and_rounded_once():
    """A token repeated 256 times: within one bf16 rounding of the fp64 sum, and nearer it than PyTorch's."""
    ids = torch.randint(0, 4, (1, 1024), generator=torch.Generator().manual_seed(2))
    gout = (torch.randn(1, 1024, H, generator=torch.Generator().manual_seed(3)) * 1e-2).to(torch.bfloat16)
    exact = torch.zeros(V, H, dtype=torch.float64).index_add_(0, ids.reshape(-1), gout.reshape(-1, H).double())
    errors = {}
    for name, lookup in (("torch", F.embedding), ("sparse", embedding_sparse_grad)):
        w = torch.zeros(V, H, dtype=torch.bfloat16, requires_grad=True)
        lookup(ids, w).backward(gout)
        errors[name] = (w.grad.to_dense().double() - exact).abs()
    assert torch.all(errors["sparse"] <= exact.abs() * 2.0 ** -8 + 1e-30)
    assert errors["sparse"].max() < errors["torch"].max()


def test_a_lone_gradient_is_one_row_per_token():
    ids = torch.tensor([[5, 2, 5, 7]])
    w = torch.randn(V, H, requires_grad=True)
    embedding_sparse_grad(ids, w).sum().backward()
    grad = w.grad
    assert grad.is_sparse and grad._nnz() == ids.numel()
    assert torch.equal(grad.to_dense(), torch.zeros(V, H).index_add_(0, ids.reshape(-1), torch.ones(4, H)))


def test_bad_ids_are_refused():
    with pytest.raises(TypeError, match="int32 or int64"):
        embedding_sparse_grad(torch.tensor([0.0]), torch.randn(V, H))


def _tied_llama(vocab=97, hidden=32):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()  # eval: no dropout, gradients still flow


def _batch(vocab=97, seq=24):
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(4))
    return {"input_ids": ids, "labels": ids.clone()}


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_patched_tied_model_sums_as_the_dense_lookup_and_unpatches():
    model = slimfit.patch(_tied_llama(), SlimFitConfig(lm_head_chunk_rows=5))
    embedding = model.get_input_embeddings()
    assert TIED_EMBEDDING in vars(embedding)
    assert any(kind == "tied embedding" for _, kind, _ in model.slimfit_summary.patched)
    dense_twin = copy.deepcopy(model)
    unpatch_tied_embedding(dense_twin.get_input_embeddings())
    calls = []
    embedding.register_forward_hook(lambda m, i, o: calls.append(o.grad_fn.name()))
    for m in (model, dense_twin):
        m(**_batch()).loss.backward()
    assert calls == ["_EmbeddingSparseGradBackward"]
    sparse_grads, dense_grads = _grads(model), _grads(dense_twin)
    assert sparse_grads.keys() == dense_grads.keys()
    for name in dense_grads:
        assert sparse_grads[name].layout == torch.strided
        assert torch.equal(sparse_grads[name], dense_grads[name]), name
    slimfit.unpatch(model)
    assert type(embedding) is torch.nn.Embedding and TIED_EMBEDDING not in vars(embedding)


def test_a_gradient_without_the_heads_is_made_dense_before_any_optimizer():
    """A backward through the hidden states alone: the embedding's gradient arrives alone, and .grad is dense."""
    model = slimfit.patch(_tied_llama(), SlimFitConfig(lm_head_chunk_rows=5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tied_weight_one_gradient(model, model.get_output_embeddings().weight):
        hidden = model.model(input_ids=_batch()["input_ids"]).last_hidden_state
    hidden.square().mean().backward()
    grad = model.get_input_embeddings().weight.grad
    assert grad is not None and grad.layout == torch.strided and grad.abs().sum() > 0
    opt.step()  # torch's AdamW refuses sparse gradients: this would raise


def test_untied_and_transformed_embeddings_are_left_alone():
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=False)
    untied = slimfit.patch(transformers.LlamaForCausalLM(cfg), SlimFitConfig(lm_head_chunk_rows=5))
    assert TIED_EMBEDDING not in vars(untied.get_input_embeddings())
    tied = _tied_llama()

    class Scaled(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2.0

    scaled = Scaled(97, 32)
    scaled.weight = tied.model.embed_tokens.weight
    tied.model.embed_tokens = scaled
    patched = slimfit.patch(tied, SlimFitConfig(lm_head_chunk_rows=5))
    assert TIED_EMBEDDING not in vars(scaled)
    assert any(kind == "Scaled" and "own forward" in why for _, kind, why in patched.slimfit_summary.skipped)


def test_frozen_tied_weight_takes_the_dense_lookup():
    model = slimfit.patch(_tied_llama(), SlimFitConfig(lm_head_chunk_rows=5))
    model.get_input_embeddings().weight.requires_grad_(False)
    calls = []
    model.get_input_embeddings().register_forward_hook(lambda m, i, o: calls.append(o.grad_fn))
    model(**_batch()).loss.backward()
    assert calls == [None]


def test_the_step_peak_holds_one_vocabulary_sized_gradient_fewer():
    """A 16384-row tied head: with the dense lookup backward holds two head-sized gradients at their sum; with the
    sparse one the peak is the head's own backward (its gradient and a few chunks of logits)."""
    vocab, hidden, rows = 16384, 64, 16
    batch = _batch(vocab, 16)
    patched = slimfit.patch(_tied_llama(vocab, hidden), SlimFitConfig(lm_head_chunk_rows=rows))
    dense = copy.deepcopy(patched)
    unpatch_tied_embedding(dense.get_input_embeddings())
    rises = {}
    for name, m in (("sparse", patched), ("dense", dense)):
        run = measure_step(m, batch)
        rises[name] = run.total - run.resident
    head, chunk = vocab * hidden * 4, rows * vocab * 4
    assert rises["dense"] >= 2 * head, (rises, head)
    assert head <= rises["sparse"] <= head + 3 * chunk, (rises, head, chunk)


def test_the_lookup_saves_only_its_ids():
    """Saved for backward: the token ids alone (no rows of the weight, no output)."""
    ids = torch.randint(0, V, (3, 11), generator=torch.Generator().manual_seed(5))
    w = torch.randn(V, H, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        embedding_sparse_grad(ids, w)
    assert len(saved) == 1 and saved[0].dtype == torch.int64
    assert saved[0].numel() * saved[0].element_size() == ids.numel() * 8
