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

Only classes whose forward is known to be `logits = lm_head(hidden); loss = loss_function(logits, labels,
vocab_size, **kwargs)` with nothing in between (no logit scaling or soft-capping) are patched; others
are left alone and reported in the summary.
"""
from __future__ import annotations

import dataclasses
import inspect
import types

import torch
from torch import nn

from ..autograd.linear_cross_entropy import causal_lm_loss

__all__ = ["SUPPORTED", "patch_causal_lm", "unpatch_causal_lm", "CAUSAL_LM_OPTIONS"]

CAUSAL_LM_OPTIONS = "_slimfit_causal_lm"
# Checked against the installed transformers' modeling code (forward signatures and bodies).
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GPT2LMHeadModel")
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


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
    if cls.__name__ not in SUPPORTED or not cls.__module__.startswith("transformers."):
        return (f"chunked LM loss knows {', '.join(SUPPORTED)} (their forward applies nothing between head and "
                "loss); this class keeps its own head and loss")
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


def _output_class(cls: type):
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils import ModelOutput

    annotation = inspect.signature(cls.forward).return_annotation
    if isinstance(annotation, type) and issubclass(annotation, ModelOutput):
        return annotation
    return CausalLMOutputWithPast


def _chunked_forward(self, *args, **kwargs):
    original = type(self).forward
    if not torch.is_grad_enabled():
        return original(self, *args, **kwargs)
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    arguments = dict(bound.arguments)
    labels = arguments.get("labels")
    keep = arguments.get("logits_to_keep", 0)
    head = self.get_output_embeddings()
    if (labels is None or not isinstance(keep, int) or keep != 0 or not isinstance(head, nn.Linear)
            or self.loss_function is not _hf_causal_lm_loss()):
        return original(self, *args, **kwargs)

    # The arguments the model's own forward gives its base model: every named one but labels and
    # logits_to_keep, plus **kwargs (transformers passes them to both the base model and the loss).
    extra = dict(arguments.pop("kwargs", {}))
    for name in ("self", "labels", "logits_to_keep"):
        arguments.pop(name, None)
    return_dict = extra.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    outputs = self.base_model(**arguments, **extra)
    loss = causal_lm_loss(outputs.last_hidden_state, head.weight, head.bias, labels,
                          shift_labels=extra.get("shift_labels"), ignore_index=extra.get("ignore_index", -100),
                          num_items_in_batch=extra.get("num_items_in_batch"),
                          chunk_rows=getattr(self, CAUSAL_LM_OPTIONS)["chunk_rows"])
    out_cls = _output_class(type(self))
    fields = {field.name: getattr(outputs, field.name, None) for field in dataclasses.fields(out_cls)
              if field.name not in ("loss", "logits")}
    out = out_cls(loss=loss, logits=None, **fields)
    return out if return_dict else out.to_tuple()


def patch_causal_lm(model: nn.Module, chunk_rows: int, summary) -> None:
    """Rebind the forward of every supported *ForCausalLM module in `model` (the model itself, or the
    one inside a wrapper such as a PEFT model); report the others in `summary.skipped`."""
    for name, module in model.named_modules():
        if not _is_causal_lm_class(type(module)) or not hasattr(module, "get_output_embeddings"):
            continue
        path = name or "(root)"
        why = _why_not(module)
        if why is not None:
            summary.skipped.append((path, type(module).__name__, why))
            continue
        setattr(module, CAUSAL_LM_OPTIONS, {"chunk_rows": int(chunk_rows)})
        module.forward = types.MethodType(_chunked_forward, module)
        summary.patched.append((path, "causal-lm loss", f"chunked linear + cross-entropy, {chunk_rows} rows per "
                                "chunk (no logits kept; logits=None in training)"))


def unpatch_causal_lm(model: nn.Module) -> None:
    for module in model.modules():
        if CAUSAL_LM_OPTIONS in vars(module):
            delattr(module, CAUSAL_LM_OPTIONS)
            vars(module).pop("forward", None)
