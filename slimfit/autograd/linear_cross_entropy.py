"""Linear + cross-entropy in chunks of rows: the B·S·vocab logits of a language-model head are
never kept for backward (nor held whole at any time).

    loss = linear_cross_entropy(hidden, weight, bias, labels)           # mean over non-ignored labels
    loss = causal_lm_loss(hidden, weight, bias, labels)                 # + Hugging Face's shift

Forward computes the logits of `chunk_rows` rows at a time (fewer at a large vocabulary: at most
CHUNK_LOGIT_ELEMENTS logits a chunk, 55 rows at 152k; in the compute dtype: the input's, or the
autocast dtype), upcasts them to fp32 as transformers' `ForCausalLMLoss` does, and keeps one
logsumexp per row. What is saved depends on what needs a gradient (the scheduler's contract,
`weight.requires_grad`):

* trainable head weight (or bias): the input rows (compute dtype), the fp32 logsumexp per row and
  the labels; backward recomputes each chunk's logits and forms the input and bias gradients chunk
  by chunk; an fp32 head computed in fp32 has its weight gradient summed in place in that pass
  (one extra head GEMM); any other head's weight gradient is formed a block of vocabulary rows at a
  time (the block's logits recomputed for every chunk, summed in fp32, rounded once): two extra
  head GEMMs, and no (vocab, hidden) fp32 sum at the peak (6x a bf16 head's bytes);
* frozen head (only the input needs a gradient): the input gradient is formed in forward, chunk by
  chunk, and is the only thing saved (as many bytes as the input); backward scales it by the
  incoming gradient. No logits are recomputed and no weight-gradient GEMM runs.

Tied embeddings need nothing special: the head weight is the embedding's parameter, and autograd
adds this function's weight gradient to the embedding's.

Reduction as transformers': the sum of the per-row losses divided by the number of non-ignored
labels, or by `num_items_in_batch` when given. A batch whose labels are all ignored gives NaN (0/0)
and zero gradients, as `F.cross_entropy` does. On the CPU, rows whose label is ignored are dropped
before the head GEMM (exact: they contribute nothing) unless those rows, the weight or the bias hold
a NaN/Inf; on other devices every row is computed, so the step never waits for the host to count them.

NaN/Inf as PyTorch: a row of logits holding NaN or +Inf (or only -Inf) has a NaN log-softmax, so
its loss and its gradients are NaN, also for a row whose label is ignored (its zero gradient is
multiplied by NaN probabilities). torch.logsumexp gives ±Inf for such rows, which would leave finite
gradient entries, so the row's logsumexp is made NaN; and an ignored row is dropped on the CPU only
when it is finite (its gradients are then exactly zero, as PyTorch's). A NaN/Inf incoming gradient
makes every gradient entry NaN/Inf, the input rows whose label is ignored included (0 · grad, dropped
rows too): PyTorch's own GEMMs may spread it there (oneDNN's AMX bf16 matmul can leak NaN into other
rows when K is not a multiple of 32: uxlfoundation/oneDNN#5717), and a finite value must never hide it.

Final soft-capping (Gemma2: `softcap=config.final_logit_softcapping`): the loss sees cap · tanh(raw / cap) of
each chunk's logits, computed as Gemma2's forward does (in the compute dtype, before the fp32 upcast); backward
multiplies the logits' gradient by 1 - tanh² of the recomputed raw logits.

Options: `LinearCrossEntropyOptions` (ignore_index, chunk_rows, softcap), checked once when built.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ._common import (
    autocast_dtype,
    backward_once,
    call_options,
    cast,
    check_float,
    check_same_device,
    check_same_dtype,
    no_autocast,
)
from .head_grad_later import head_grad_later_of

__all__ = ["linear_cross_entropy", "causal_lm_loss", "DEFAULT_CHUNK_ROWS", "LinearCrossEntropyOptions"]

DEFAULT_CHUNK_ROWS = 256
# A chunk holds at most this many logits (fp32: 32 MiB; with its 16-bit logits and logsumexp's temporary about
# 10 bytes each at the forward's peak), and at least MIN_CHUNK_ROWS rows: at a 152k vocabulary 256 rows would be
# 148 MiB of fp32 logits and about 370 MiB in all, the whole step's largest transient
CHUNK_LOGIT_ELEMENTS = 8 * 2**20
MIN_CHUNK_ROWS = 16


def chunk_rows_for(chunk_rows: int, vocab: int) -> int:
    """The rows of logits made at a time: `chunk_rows`, fewer where a chunk would pass CHUNK_LOGIT_ELEMENTS."""
    return max(1, min(chunk_rows, max(MIN_CHUNK_ROWS, CHUNK_LOGIT_ELEMENTS // max(vocab, 1))))


@dataclass(frozen=True)
class LinearCrossEntropyOptions:
    """The label that counts for nothing (`ignore_index`) and the rows of logits made at a time
    (`chunk_rows`: the only S×vocab memory, chunk_rows × vocab fp32; fewer rows where a chunk would hold more
    than CHUNK_LOGIT_ELEMENTS logits, chunk_rows_for). Checked once, here."""

    op: ClassVar[str] = "linear_cross_entropy"
    ignore_index: int = -100
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    softcap: float | None = None  # final logit soft-capping: cap · tanh(logits / cap) (Gemma2)

    def __post_init__(self):
        rows = self.chunk_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"slimfit.linear_cross_entropy: chunk_rows must be an int >= 1, got {rows!r}")
        cap = self.softcap
        number = isinstance(cap, (int, float)) and not isinstance(cap, bool)
        if cap is not None and not (number and 0 < cap < float("inf")):
            raise ValueError(f"slimfit.linear_cross_entropy: softcap must be None or a finite number > 0 (the "
                             f"model's final_logit_softcapping), got {cap!r}")


def _chunk_grad_logits(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                       row_scale: torch.Tensor, first_class: int | None = None) -> torch.Tensor:
    """d loss / d logits of one chunk (fp32, in place on `logits`): (softmax - onehot) * row_scale,
    zero on ignored rows of finite logits (row_scale is 0 · grad there: 0, or NaN for a NaN/Inf grad).
    first_class: the logits are a block of classes from there on; only the labels inside it get their -1."""
    probs = logits.sub_(lse.unsqueeze(1)).exp_()
    if first_class is not None:
        labels = labels - first_class
        valid = valid & (labels >= 0) & (labels < probs.shape[1])
        labels = torch.where(valid, labels, 0)
    probs.scatter_add_(1, labels.unsqueeze(1), -valid.to(probs.dtype).unsqueeze(1))
    return probs.mul_(row_scale.unsqueeze(1))


def _head(xc: torch.Tensor, w: torch.Tensor, b, softcap: float | None):
    """(the fp32 logits the loss sees, d logits / d raw logits or None): with soft-capping, cap · tanh(raw / cap)
    in the compute dtype before the upcast, as Gemma2's forward computes them."""
    raw = F.linear(xc, w, b)
    if softcap is None:
        return raw.float(), None
    t = torch.tanh(raw / softcap)
    slope = 1.0 - t.float().square()
    return (t * softcap).float(), slope


def _zero_times(grad_loss: torch.Tensor) -> torch.Tensor:
    """0 · grad_loss without a -0: +0 for a finite gradient, NaN for NaN/±Inf (a tensor op: no host sync)."""
    return grad_loss - grad_loss


def _all_rows(grad: torch.Tensor, keep, rows: int, fill: torch.Tensor) -> torch.Tensor:
    """The gradient of every input row from that of the computed rows `keep` (None: all were computed);
    the dropped rows get `fill` (0 · grad_loss). Filled, then index_add_, as index_select's backward
    (zeros, then index_add_): the same bits for a finite gradient."""
    if keep is None:
        return grad
    out = grad.new_empty((rows,) + tuple(grad.shape[1:])).copy_(fill)
    return out.index_add_(0, keep, grad)


def _nan_if_inf(lse: torch.Tensor) -> torch.Tensor:
    """logsumexp rows that are ±Inf (a +Inf logit, or every logit -Inf) become NaN, as PyTorch's
    log_softmax makes the whole row (exp(inf - inf)); finite rows unchanged (lse + 0)."""
    return lse + (lse - lse)


def _ignored_rows_finite(x2: torch.Tensor, valid: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """0-dim bool: whether the rows with an ignored label, the weight and the bias hold no NaN/Inf, i.e.
    whether dropping those rows is exact (their logits finite, their gradients zero). Sums, one pass
    each (isfinite().all() on a vocab-sized weight costs ~30x more); a sum that overflows a finite
    tensor only keeps the rows, which is exact too."""
    with torch.no_grad():  # a check, not part of the graph (nothing saved for backward)
        probe = torch.where(valid, 0.0, x2.sum(dim=1, dtype=torch.float32)).sum() + weight.sum(dtype=torch.float32)
        if bias is not None:
            probe = probe + bias.sum(dtype=torch.float32)
        return probe.isfinite()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, labels, denominator, options, compute_dtype, keep):
        # keep: None, or the index of the rows computed (labels are theirs); x holds every row
        ctx.rows = x.shape[0]
        if keep is not None:
            x = x.index_select(0, keep)
        ignore_index, chunk_rows = options.ignore_index, chunk_rows_for(options.chunk_rows, weight.shape[0])
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        eager = need_x and not (need_w or need_b)
        device_type = x.device.type
        n = x.shape[0]
        valid_all = labels != ignore_index
        safe_all = torch.where(valid_all, labels, torch.zeros_like(labels))
        # Per-row factor of the gradient, without the incoming gradient: 1/denominator on
        # labelled rows, 0 elsewhere (also when the denominator is 0: no NaN in the gradient).
        scale_all = torch.where(valid_all, 1.0 / denominator, torch.zeros((), device=x.device))
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        lse_all = torch.empty(n, dtype=torch.float32, device=x.device) if not eager else None
        grad_x = torch.empty_like(x) if eager else None
        with no_autocast(device_type):
            w = weight.to(compute_dtype)
            b = cast(bias, compute_dtype)
            for start in range(0, n, chunk_rows):
                end = min(start + chunk_rows, n)
                xc = x[start:end].to(compute_dtype)
                logits, slope = _head(xc, w, b, options.softcap)  # fp32 upcast, as ForCausalLMLoss
                lse = _nan_if_inf(torch.logsumexp(logits, dim=1))
                valid, safe = valid_all[start:end], safe_all[start:end]
                target = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
                total = total + torch.where(valid, lse - target, torch.zeros_like(lse)).sum()
                if eager:
                    g = _chunk_grad_logits(logits, lse, safe, valid, scale_all[start:end])
                    g = g if slope is None else g.mul_(slope)
                    grad_x[start:end] = g.to(compute_dtype).mm(w).to(x.dtype)
                else:
                    lse_all[start:end] = lse
        ctx.eager = eager
        ctx.later = head_grad_later_of(weight)   # a tied head: its weight gradient made when the embedding's arrives
        ctx.chunk_rows, ctx.softcap = chunk_rows, options.softcap
        ctx.compute_dtype = compute_dtype
        ctx.device_type = device_type
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        if eager:
            ctx.save_for_backward(grad_x, keep)
        else:
            # The weight and bias are parameters (no activation memory); x in the compute dtype, as
            # F.linear under autocast would keep it.
            ctx.ignore_index = ignore_index
            ctx.save_for_backward(x.to(compute_dtype), weight, bias, lse_all, labels, denominator, keep)
        return total / denominator

    @staticmethod
    @backward_once("linear_cross_entropy")
    def backward(ctx, grad_loss):
        fill = _zero_times(grad_loss)  # the gradient of an ignored input row
        if ctx.eager:
            grad_x, keep = ctx.saved_tensors
            grad_x = _all_rows((grad_x * grad_loss).to(ctx.x_dtype), keep, ctx.rows, fill)
            return grad_x, None, None, None, None, None, None, None
        x, weight, bias, lse_all, labels, denominator, keep = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        cd = ctx.compute_dtype
        valid_all = labels != ctx.ignore_index
        safe_all = torch.where(valid_all, labels, torch.zeros_like(labels))
        row_scale_all = torch.where(valid_all, grad_loss.float() / denominator, fill.float())
        rows = _RowGrads(x, lse_all, safe_all, valid_all, row_scale_all, ctx.chunk_rows, ctx.softcap)
        grad_x = grad_w = grad_b = None
        with no_autocast(ctx.device_type):
            w = weight.to(cd)
            b = cast(bias, cd)
            # an fp32 head computed in fp32: its gradient is summed in place in the one pass (addmm_: no product
            # of the head's size per chunk, no extra GEMM); otherwise a block of vocabulary rows at a time
            in_place = need_w and cd == torch.float32 and ctx.w_dtype == torch.float32
            if need_x or need_b or in_place:
                grad_x, grad_b, grad_w = _one_pass(rows, w, b, ctx.x_dtype if need_x else None,
                                                   ctx.b_dtype if need_b else None, in_place)
            if need_w and not in_place:
                if ctx.later is not None:   # a tied head (head_grad_later.py): the same bits, made later
                    ctx.later.keep(functools.partial(_weight_grad_later, rows, weight.detach(), bias, cd,
                                                     ctx.w_dtype, ctx.device_type))
                else:
                    grad_w = _weight_grad(rows, w, b, ctx.w_dtype)
        grad_x = None if grad_x is None else _all_rows(grad_x, keep, ctx.rows, fill)
        return grad_x, grad_w, grad_b, None, None, None, None, None


@dataclass
class _RowGrads:
    """What backward recomputes the logits' gradient from: the saved rows (compute dtype), their fp32
    logsumexp, labels (ignored ones made 0), which rows count and each row's factor."""

    x: torch.Tensor
    lse: torch.Tensor
    safe: torch.Tensor
    valid: torch.Tensor
    row_scale: torch.Tensor
    chunk_rows: int
    softcap: float | None

    def grad_logits(self, start: int, end: int, w: torch.Tensor, b, first_class: int | None = None) -> torch.Tensor:
        """d loss / d logits of rows [start, end) over the classes of ``w`` (the whole head, or a block of its
        rows from ``first_class`` on), fp32: (softmax - onehot) * row_scale, times the soft-cap's slope."""
        logits, slope = _head(self.x[start:end], w, b, self.softcap)
        g = _chunk_grad_logits(logits, self.lse[start:end], self.safe[start:end], self.valid[start:end],
                               self.row_scale[start:end], first_class)
        return g if slope is None else g.mul_(slope)


def _one_pass(rows: _RowGrads, w: torch.Tensor, b, x_dtype, b_dtype, weight_in_place: bool):
    """(input gradient in x_dtype, bias gradient in b_dtype, fp32 weight gradient), each None when not asked
    (x_dtype / b_dtype None, weight_in_place False), a chunk of rows at a time over the whole vocabulary: the
    only vocabulary-wide memory is one chunk's logits (and the weight gradient itself, summed in place)."""
    n, cd = rows.x.shape[0], w.dtype
    grad_x = torch.empty(rows.x.shape, dtype=x_dtype, device=w.device) if x_dtype is not None else None
    grad_b = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) if b_dtype is not None else None
    grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if weight_in_place else None
    for start in range(0, n, rows.chunk_rows):
        end = min(start + rows.chunk_rows, n)
        g = rows.grad_logits(start, end, w, b).to(cd)
        if grad_x is not None:
            grad_x[start:end] = g.mm(w).to(x_dtype)
        if grad_b is not None:
            grad_b += g.sum(0)
        if grad_w is not None:
            grad_w.addmm_(g.t(), rows.x[start:end])
    return grad_x, (None if grad_b is None else grad_b.to(b_dtype)), grad_w


# The fp32 block sum of a 16-bit head's weight gradient: at most 64 MiB (with its 16-bit product, 96 MiB beside the
# gradient at the loss's backward: a 152k x 896 head would otherwise hold 148 + 74 MiB)
_BLOCK_SUM_ELEMENTS = 16 * 2**20


def _weight_grad(rows: _RowGrads, w: torch.Tensor, b, w_dtype) -> torch.Tensor:
    """The head weight's gradient in ``w_dtype``, a block of vocabulary rows at a time: each block summed over
    every chunk of rows in fp32, then rounded once into the gradient. A whole (vocab, hidden) fp32 accumulator
    (and a vocab-wide product per chunk) would cost 6x a bf16 head's bytes at the peak: 0.8 GiB for a 152k
    vocabulary at hidden 896. A block has as many elements as a chunk's logits, so neither is the larger, and at
    most _BLOCK_SUM_ELEMENTS: the block's count changes no FLOPs (each block's logits are recomputed for every
    chunk of rows, one head GEMM in all), only how many GEMMs share them."""
    n, vocab, hidden = rows.x.shape[0], w.shape[0], w.shape[1]
    block = max(1, min(vocab, rows.chunk_rows * vocab // max(hidden, 1), _BLOCK_SUM_ELEMENTS // max(hidden, 1)))
    grad_w = torch.empty(w.shape, dtype=w_dtype, device=w.device)
    # one fp32 sum for every block, zeroed per block: a new one per block would hold two at the peak (the next is
    # made before the last is freed: 2 x 148 MiB at a 152k vocabulary, hidden 896)
    whole = torch.empty((min(block, vocab), hidden), dtype=torch.float32, device=w.device)
    for first in range(0, vocab, block):
        last = min(first + block, vocab)
        wb, bb = w[first:last], (None if b is None else b[first:last])
        acc = whole[:last - first].zero_()
        for start in range(0, n, rows.chunk_rows):
            end = min(start + rows.chunk_rows, n)
            g = rows.grad_logits(start, end, wb, bb, first).to(w.dtype)
            acc += g.t().mm(rows.x[start:end])
        grad_w[first:last] = acc
    return grad_w


def _weight_grad_later(rows: _RowGrads, weight: torch.Tensor, bias, compute_dtype, w_dtype, device_type):
    """_weight_grad made later (HeadGradLater.take): the head cast to the compute dtype then, not held till then."""
    with no_autocast(device_type):
        return _weight_grad(rows, weight.to(compute_dtype), cast(bias, compute_dtype), w_dtype)


def _check_labels(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Labels outside [0, vocab) other than ignore_index: a clear error (F.cross_entropy raises too).
    Checked on the CPU only, where reading the result costs no device synchronisation."""
    if labels.device.type != "cpu":
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if torch.compiler.is_compiling():   # in a graph: an assertion the graph runs (no branch on the value)
        torch._assert_async(~bad.any(), f"slimfit.linear_cross_entropy: a label is outside [0, {vocab}) (the "
                            f"head's vocabulary) and is not ignore_index={ignore_index}")
        return
    if bool(bad.any()):
        value = int(labels[bad][0])
        raise ValueError(f"slimfit.linear_cross_entropy: label {value} is outside [0, {vocab}) (the head's "
                         f"vocabulary) and is not ignore_index={ignore_index}")


def _check_args(x, weight, bias, labels) -> None:
    """The tensors checked before anything runs, each error naming the problem and the fix."""
    check_float("linear_cross_entropy", "input", x)
    check_float("linear_cross_entropy", "weight", weight)
    check_float("linear_cross_entropy", "bias", bias)
    check_same_device("linear_cross_entropy", input=x, weight=weight, bias=bias)
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"slimfit.linear_cross_entropy: input {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         "do not match: weight must be (vocab, hidden) with hidden = the input's last dimension")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"slimfit.linear_cross_entropy: bias {tuple(bias.shape)} must be ({weight.shape[0]},)")
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError("slimfit.linear_cross_entropy: labels must be an integer tensor of class indices")
    if tuple(labels.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"slimfit.linear_cross_entropy: labels {tuple(labels.shape)} must have the input's "
                         f"leading shape {tuple(x.shape[:-1])}")


def _check_num_items(num_items_in_batch) -> None:
    if torch.is_tensor(num_items_in_batch) and num_items_in_batch.numel() != 1:
        raise ValueError("slimfit.linear_cross_entropy: num_items_in_batch must be one number (the count of "
                         f"labelled tokens), got a tensor of shape {tuple(num_items_in_batch.shape)}")


def _denominator(num_items_in_batch, valid: torch.Tensor, device) -> torch.Tensor:
    """What the summed loss is divided by: the count of labelled rows, or `num_items_in_batch` (fp32, 0-dim)."""
    if num_items_in_batch is None:
        return valid.sum().float()
    if torch.is_tensor(num_items_in_batch):
        return num_items_in_batch.to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(num_items_in_batch), device=device)


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    softcap: float | None = None,
    options: LinearCrossEntropyOptions | None = None,
) -> torch.Tensor:
    """`F.cross_entropy(F.linear(x, weight, bias).float().view(-1, V), labels.view(-1), ignore_index=...)`
    (mean over non-ignored labels; or the sum divided by `num_items_in_batch` when given) without
    keeping the logits: `chunk_rows` rows of logits at a time. Returns a 0-d fp32 tensor.

    x: (..., hidden); labels: integer tensor of x's leading shape (already shifted for a causal LM).
    softcap: the model's final logit soft-capping (cap · tanh(logits / cap), Gemma2), None for none.
    options: a LinearCrossEntropyOptions built once, instead of ignore_index, chunk_rows and softcap."""
    _check_args(x, weight, bias, labels)
    options = call_options(LinearCrossEntropyOptions, options, ignore_index=ignore_index, chunk_rows=chunk_rows,
                           softcap=softcap)
    _check_num_items(num_items_in_batch)
    ignore_index = options.ignore_index
    compute_dtype = autocast_dtype(x.device.type)
    if compute_dtype is None:
        check_same_dtype("linear_cross_entropy", input=x, weight=weight, bias=bias)
        compute_dtype = x.dtype

    x2 = x.reshape(-1, x.shape[-1])
    labels = labels.reshape(-1).to(device=x.device, dtype=torch.long)
    _check_labels(labels, weight.shape[0], ignore_index)
    valid = labels != ignore_index
    denominator = _denominator(num_items_in_batch, valid, x.device)
    keep = None
    if (x.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(valid.all())
            and bool(_ignored_rows_finite(x2, valid, weight, bias))):
        # Ignored finite rows contribute nothing: skip their GEMMs (their gradient is 0 · the loss's). Not in a
        # compiled graph: the kept rows' count is data (every row is computed there, as on other devices).
        keep = valid.nonzero().squeeze(1)
        labels = labels.index_select(0, keep)
    return _LinearCrossEntropy.apply(x2, weight, bias, labels, denominator, options, compute_dtype, keep)


def causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor | None,
    *,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    softcap: float | None = None,
    options: LinearCrossEntropyOptions | None = None,
) -> torch.Tensor:
    """transformers' `ForCausalLMLoss(lm_head(hidden), labels, ...)` without the logits: position t
    predicts labels[t + 1] (the last position predicts nothing), unless `shift_labels` is given
    (then used as is). hidden: (batch, seq, hidden_size). options: as in `linear_cross_entropy`."""
    if shift_labels is None:
        if labels is None:
            raise ValueError("slimfit.causal_lm_loss: give labels or shift_labels")
        labels = labels.to(hidden.device)
        ignored = ignore_index if options is None else options.ignore_index
        shift_labels = F.pad(labels, (0, 1), value=ignored)[..., 1:]
    return linear_cross_entropy(hidden, weight, bias, shift_labels.to(hidden.device), ignore_index=ignore_index,
                                num_items_in_batch=num_items_in_batch, chunk_rows=chunk_rows, softcap=softcap,
                                options=options)
