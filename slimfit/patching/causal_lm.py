"""Causal-LM heads without full logits: `*ForCausalLM` models compute their training loss through
slimfit's chunked linear + cross-entropy (slimfit.autograd.linear_cross_entropy), so the B·S·vocab
logits are never kept for backward.

The model's `forward` is rebound on the instance (the class, parameters and state_dict keys are
unchanged; unpatch deletes the instance attribute). The rebound forward runs the model's own
forward, bit-identical, unless all of these hold: gradients are enabled, `labels` are given,
`logits_to_keep` is 0, the loss function is transformers' `ForCausalLMLoss` and the head is a plain
linear layer. Then it calls the base model with the same arguments the model's own forward passes
it, and computes the loss from the last hidden state and the head's weight (and bias):

    out = model(input_ids, attention_mask=..., labels=labels)   # out.loss as the model's own, out.logits is None

A transformers `*ForCausalLM` / `*LMHeadModel` is taken when its structure fits and a probe agrees:
its head is a linear layer of `vocab_size` rows, its loss is transformers' `ForCausalLMLoss`, no config
field scales or soft-caps the logits, and at patch time, on a small random input, the chunked loss equals
the model's own loss (so a forward that applies anything between head and loss is found and left
alone). Others are left alone and reported in the summary with the reason. A head tied to the input
embedding also gets that embedding's lookup with a sparse gradient while the loss runs
(slimfit.patching.tied_embedding): one vocabulary-sized gradient in backward, not two.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn

from ..autograd.linear_cross_entropy import causal_lm_loss
from .modules import patched_class
from .tied_embedding import (
    TIED_EMBEDDING,
    patch_tied_embedding,
    tied_weight_one_gradient,
    unpatch_tied_embedding,
    why_not_tied,
)

__all__ = ["patch_causal_lm", "unpatch_causal_lm", "CAUSAL_LM_OPTIONS"]

CAUSAL_LM_OPTIONS = "_slimfit_causal_lm"
PROBE_TOKENS = 8
# The probe's agreement bound, relative to the loss: the chunked loss and the model's own differ only by
# summation order in fp32 (about 1e-7); 16-bit logits round at about 4e-3.
PROBE_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-9}
PROBE_TOLERANCE_16BIT = 2e-2
# logit transforms the chunked loss does not compute (final_logit_softcapping it does: softcap=)
_LOGIT_TRANSFORMS = ("logit_scale", "logits_scaling", "output_multiplier_scale")


def _is_causal_lm_class(cls: type) -> bool:
    name = cls.__name__
    return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")


def _hf_causal_lm_loss():
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss
    except ImportError:  # pragma: no cover
        return None


def _why_not(model: nn.Module) -> str | None:
    """Why `model` cannot take the chunked loss (None when it can)."""
    cls = type(model)
    if not cls.__module__.startswith("transformers."):
        return ("not a transformers class (its forward may differ from its parent's): "
                "this class keeps its own head and loss")
    if "forward" in vars(model):
        return "forward is already replaced on this instance: left as is"
    cfg = getattr(model, "config", None)
    for key in _LOGIT_TRANSFORMS:
        if getattr(cfg, key, None) not in (None, 0, 0.0, 1, 1.0):
            return f"config.{key} transforms the logits: the model's own head and loss are kept"
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        return (f"output embeddings are {type(head).__name__}, not a linear layer: "
                "the model's own head and loss are kept")
    if head.weight.shape[0] != getattr(cfg, "vocab_size", head.weight.shape[0]):
        return "head rows differ from config.vocab_size: the model's own head and loss are kept"
    if model.loss_function is not _hf_causal_lm_loss():
        return "a custom loss_function is set: the model's own head and loss are kept"
    return None


def _probe_disagrees(model: nn.Module, chunk_rows: int) -> str | None:
    """Run the model's own forward and the chunked one on PROBE_TOKENS random tokens (eval mode, so no
    dropout) and compare the losses; a reason when they differ or the probe cannot run, else None."""
    head = model.get_output_embeddings()
    ids = torch.randint(0, head.weight.shape[0], (1, PROBE_TOKENS), device=head.weight.device,
                        generator=torch.Generator(device=head.weight.device).manual_seed(0))
    was_training = model.training
    setattr(model, CAUSAL_LM_OPTIONS, {"chunk_rows": int(chunk_rows)})
    try:
        model.eval()
        with torch.enable_grad():
            own = type(model).forward(model, input_ids=ids, labels=ids).loss.detach()
            chunked = _chunked_forward(model, input_ids=ids, labels=ids).loss.detach()
    except Exception as exc:  # noqa: BLE001 - any failure means: leave the model's own forward alone
        return f"the patch-time probe could not run ({type(exc).__name__}: {exc}): its own head and loss are kept"
    finally:
        model.train(was_training)
        delattr(model, CAUSAL_LM_OPTIONS)
    bound = PROBE_TOLERANCE.get(head.weight.dtype, PROBE_TOLERANCE_16BIT) * max(1.0, float(own.abs()))
    if not bool((own - chunked).abs() <= bound):
        return (f"on a probe input its own loss ({float(own):.6g}) differs from the chunked one "
                f"({float(chunked):.6g}): its forward transforms the logits; its own head and loss are kept")
    return None


def _output_class(cls: type):
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils import ModelOutput

    annotation = inspect.signature(cls.forward).return_annotation
    if isinstance(annotation, type) and issubclass(annotation, ModelOutput):
        return annotation
    return CausalLMOutputWithPast


class ChunkedLossForward:
    """The mixin of a patched causal LM (patched_class): its forward is `_chunked_forward`. A class swap,
    not a bound method stored on the instance: `module.forward = MethodType(f, module)` is a reference cycle
    that keeps the whole model (on a GPU: its memory) alive after `del model` until the cyclic GC runs."""

    def forward(self, *args, **kwargs):
        return _chunked_forward(self, *args, **kwargs)


def _chunked_forward(self, *args, **kwargs):
    original = getattr(self, CAUSAL_LM_OPTIONS).get("class", type(self)).forward
    if not torch.is_grad_enabled():
        return original(self, *args, **kwargs)
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    arguments = dict(bound.arguments)
    labels = arguments.get("labels")
    keep = arguments.get("logits_to_keep", 0)
    head = self.get_output_embeddings()
    # mixture-of-experts models add the router's auxiliary loss when asked: their own forward computes it
    router_loss = arguments.get("output_router_logits", getattr(self.config, "output_router_logits", False))
    if (labels is None or not isinstance(keep, int) or keep != 0 or not isinstance(head, nn.Linear)
            or self.loss_function is not _hf_causal_lm_loss() or router_loss):
        return original(self, *args, **kwargs)

    # The arguments the model's own forward gives its base model: every named one but labels and
    # logits_to_keep, plus **kwargs (transformers passes them to both the base model and the loss).
    extra = dict(arguments.pop("kwargs", {}))
    for name in ("self", "labels", "logits_to_keep"):
        arguments.pop(name, None)
    return_dict = extra.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    with tied_weight_one_gradient(self, head.weight) as head_weight:  # tied: one vocabulary-sized gradient
        outputs = self.base_model(**arguments, **extra)
    loss = causal_lm_loss(outputs.last_hidden_state, head_weight, head.bias, labels,
                          shift_labels=extra.get("shift_labels"), ignore_index=extra.get("ignore_index", -100),
                          num_items_in_batch=extra.get("num_items_in_batch"),
                          chunk_rows=getattr(self, CAUSAL_LM_OPTIONS)["chunk_rows"],
                          softcap=getattr(self.config, "final_logit_softcapping", None) or None)
    out_cls = _output_class(type(self))
    fields = {name: getattr(outputs, name, None) for name in _output_fields(out_cls)}
    out = out_cls(loss=loss, logits=None, **fields)
    return out if return_dict else out.to_tuple()


@torch.compiler.assume_constant_result
def _output_fields(out_cls: type) -> tuple:
    """The output class's fields but loss and logits (a compiler reads them at trace time: dataclasses.fields
    of a class is not traceable)."""
    return tuple(f.name for f in dataclasses.fields(out_cls) if f.name not in ("loss", "logits"))


def patch_causal_lm(model: nn.Module, chunk_rows: int, summary) -> None:
    """Rebind the forward of every supported *ForCausalLM module in `model` (the model itself, or the
    one inside a wrapper such as a PEFT model); report the others in `summary.skipped`."""
    for name, module in model.named_modules():
        if not _is_causal_lm_class(type(module)) or not hasattr(module, "get_output_embeddings"):
            continue
        path = name or "(root)"
        why = _why_not(module)
        if why is None:
            why = _probe_disagrees(module, chunk_rows)
        if why is not None:
            summary.skipped.append((path, type(module).__name__, why))
            continue
        setattr(module, CAUSAL_LM_OPTIONS, {"chunk_rows": int(chunk_rows), "class": type(module)})
        module.__class__ = patched_class(type(module), ChunkedLossForward)
        summary.patched.append((path, "causal-lm loss", f"chunked linear + cross-entropy, {chunk_rows} rows per "
                                "chunk (no logits kept; logits=None in training)"))
        _patch_tied(module, path, summary)


def _patch_tied(module: nn.Module, path: str, summary) -> None:
    """The tied input embedding of a patched causal LM: its gradient sparse (slimfit.patching.tied_embedding)."""
    why = why_not_tied(module)
    if why == "":
        return
    embedding = module.get_input_embeddings()
    name = next((f"{path}.{n}" if path != "(root)" else n for n, m in module.named_modules() if m is embedding),
                path)
    if why is not None:
        summary.skipped.append((name, type(embedding).__name__, why))
        return
    patch_tied_embedding(module)
    summary.patched.append((name, "tied embedding", "gradient one row per token (sparse) while the chunked loss "
                            "takes the head's: no second vocabulary-sized gradient"))


def unpatch_causal_lm(model: nn.Module) -> None:
    for module in model.modules():
        if TIED_EMBEDDING in vars(module):
            unpatch_tied_embedding(module)
        if CAUSAL_LM_OPTIONS in vars(module):
            module.__class__ = vars(module)[CAUSAL_LM_OPTIONS].get("class", type(module))
            delattr(module, CAUSAL_LM_OPTIONS)
