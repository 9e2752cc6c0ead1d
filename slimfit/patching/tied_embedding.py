"""A tied input embedding's gradient kept sparse while the chunked LM loss takes the head's gradient.

A causal LM whose head weight is its input embedding's (`tie_word_embeddings`: Qwen2.5-0.5B/1.5B, Llama-3.2-1B/3B,
SmolLM2) gets two gradients of that (vocab, hidden) parameter in backward; PyTorch's embedding makes its one
dense, so two vocab-sized tensors are alive when autograd adds them (Qwen2.5-0.5B bf16: 2 x 260 MiB; Llama-3.2-1B:
2 x 501 MiB). While a patched causal LM's forward computes its chunked loss (slimfit.patching.causal_lm), the
lookup and the head take two aliases of the weight (`slimfit.autograd.sparse_embedding.tied_uses`): the lookup's
gradient is one row per token, added in place into the head's dense gradient in one backward. The parameter's
`.grad` is dense, and arrives as one tensor.

Taken only where it is exact: the embedding's class keeps `nn.Embedding.forward` (a subclass that scales or
transforms its output is left alone), no `max_norm`, `scale_grad_by_freq` or `sparse=True` of its own. At run
time the lookup is PyTorch's own unless the chunked loss is being computed with gradients, the weight trains,
it is a plain tensor (FSDP2's DTensor shards sum their own way) and nothing is being compiled.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..autograd.sparse_embedding import embedding_sparse_grad, tied_uses
from .modules import patched_class

__all__ = ["patch_tied_embedding", "unpatch_tied_embedding", "tied_weight_one_gradient", "why_not_tied"]

TIED_EMBEDDING = "_slimfit_tied_embedding"  # on the embedding: its own class
_ALIAS = "_slimfit_tied_alias"  # on the embedding while the chunked loss runs: the lookup's alias of the weight


class SparseGradEmbeddingForward:
    """The mixin of a tied input embedding: while the chunked loss runs, the lookup of its alias (sparse gradient)."""

    def forward(self, input):
        alias = vars(self).get(_ALIAS)
        if alias is not None:
            return embedding_sparse_grad(input, alias, self.padding_idx)
        return vars(self)[TIED_EMBEDDING].forward(self, input)


def _takes_sparse(weight: torch.Tensor) -> bool:
    from ..scheduler.sharded import is_sharded

    return (torch.is_grad_enabled() and weight.requires_grad and not is_sharded(weight)
            and not torch.compiler.is_compiling())


def why_not_tied(model: nn.Module) -> str | None:
    """Why the input embedding of causal LM `model` does not take a sparse gradient (None when it does);
    '' when its head is not tied to it (nothing to say)."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding is None or head is None or getattr(embedding, "weight", None) is not getattr(head, "weight", None):
        return ""
    if not isinstance(embedding, nn.Embedding) or type(embedding).forward is not nn.Embedding.forward:
        return (f"its input embedding ({type(embedding).__name__}) has its own forward: its gradient stays dense "
                "(a second vocabulary-sized tensor at the head's gradient sum)")
    if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
        return ("its input embedding sets max_norm, scale_grad_by_freq or sparse: its own lookup is kept, its "
                "gradient as PyTorch makes it")
    return None


def patch_tied_embedding(model: nn.Module) -> nn.Module:
    """Swap the tied input embedding's class (why_not_tied(model) must be None); returns the embedding."""
    embedding = model.get_input_embeddings()
    if TIED_EMBEDDING in vars(embedding):
        return embedding
    setattr(embedding, TIED_EMBEDDING, type(embedding))
    embedding.__class__ = patched_class(type(embedding), SparseGradEmbeddingForward)
    return embedding


def unpatch_tied_embedding(embedding: nn.Module) -> None:
    original = vars(embedding).pop(TIED_EMBEDDING, None)
    if original is not None:
        embedding.__class__ = original
        vars(embedding).pop(_ALIAS, None)


@contextlib.contextmanager
def tied_weight_one_gradient(model: nn.Module, head_weight: torch.Tensor):
    """While inside, the patched tied embedding of `model` (if any, and where `_takes_sparse`) looks up an alias of
    the weight whose gradient is sparse; yields the weight the head must use (the other alias, or `head_weight`).
    The head must use it inside the same forward, so both gradients meet in one backward."""
    embedding = model.get_input_embeddings()
    if embedding is None or TIED_EMBEDDING not in vars(embedding) or not _takes_sparse(head_weight):
        yield head_weight
        return
    for_embedding, for_head = tied_uses(head_weight)
    setattr(embedding, _ALIAS, for_embedding)
    try:
        yield for_head
    finally:
        vars(embedding).pop(_ALIAS, None)
