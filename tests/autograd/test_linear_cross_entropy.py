"""slimfit.autograd.linear_cross_entropy / causal_lm_loss: loss and gradients equal to transformers'
ForCausalLMLoss(lm_head(hidden)) within fp32 rounding, never a B·S·vocab tensor saved, the frozen head
without logits recomputation nor weight-gradient GEMM."""
import importlib

import pytest
import torch
import torch.nn.functional as F
from _grad_utils import nonfinite_missed, rel_err, single_thread  # noqa: F401  (single_thread: autouse)
from torch.utils._python_dispatch import TorchDispatchMode

from slimfit.autograd.linear_cross_entropy import causal_lm_loss, linear_cross_entropy
from slimfit.memory import measure

loss_utils = pytest.importorskip("transformers.loss.loss_utils")
hf_loss = loss_utils.ForCausalLMLoss

B, S, H, V = 3, 13, 24, 101  # odd sizes: chunks do not divide the rows


def _setup(seed=0, bias=True, ignore=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / H**0.5).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).requires_grad_() if bias else None
    labels = torch.randint(0, V, (B, S), generator=g)
    if ignore:
        labels[0, :5] = -100   # a prompt
        labels[2, -3:] = -100  # padding
    return hidden, weight, b, labels


def _grads(loss, tensors):
    tensors = [t for t in tensors if t is not None and t.requires_grad]
    return torch.autograd.grad(loss, tensors)


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_rows", [1, 4, 16, 1000])
@pytest.mark.parametrize("trainable", ["all", "head_frozen", "input_frozen"])
@pytest.mark.parametrize("bias", [True, False])
def test_loss_and_gradients_match_hf(chunk_rows, trainable, bias):
    hidden, weight, b, labels = _setup(bias=bias)
    if trainable == "head_frozen":
        weight.requires_grad_(False)
        if b is not None:
            b.requires_grad_(False)
    elif trainable == "input_frozen":
        hidden.requires_grad_(False)
    ref = hf_loss(F.linear(hidden, weight, b), labels, V)
    got = causal_lm_loss(hidden, weight, b, labels, chunk_rows=chunk_rows)
    assert got.dtype == torch.float32 and got.shape == ()
    _close(got, ref)
    for a, r in zip(_grads(got, [hidden, weight, b]), _grads(ref, [hidden, weight, b])):
        _close(a, r)


def test_scaled_loss_and_num_items_in_batch_and_shift_labels():
    hidden, weight, b, labels = _setup()
    n = torch.tensor(57)
    ref = hf_loss(F.linear(hidden, weight, b), labels, V, num_items_in_batch=n) * 3.0
    got = causal_lm_loss(hidden, weight, b, labels, num_items_in_batch=n, chunk_rows=8) * 3.0
    _close(got, ref)
    for a, r in zip(_grads(got, [hidden, weight, b]), _grads(ref, [hidden, weight, b])):
        _close(a, r)
    # an int num_items_in_batch and a frozen head (gradient formed in forward, scaled in backward)
    weight.requires_grad_(False)
    ref = hf_loss(F.linear(hidden, weight, b.detach()), labels, V, num_items_in_batch=40) * 0.5
    got = causal_lm_loss(hidden, weight, b.detach(), labels, num_items_in_batch=40) * 0.5
    _close(got, ref)
    _close(_grads(got, [hidden])[0], _grads(ref, [hidden])[0])
    # shift_labels given: used as is
    shifted = torch.roll(labels, 2, dims=1)
    ref = hf_loss(F.linear(hidden, weight, b), None, V, shift_labels=shifted)
    _close(causal_lm_loss(hidden, weight, b, None, shift_labels=shifted), ref)


def test_tied_embedding_gradient_accumulates_into_one_parameter():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(V, H)
    body = torch.nn.Linear(H, H)
    ids = torch.randint(0, V, (B, S))
    labels = ids.clone()
    labels[1, :3] = -100

    def run(chunked):
        emb.zero_grad(set_to_none=True), body.zero_grad(set_to_none=True)
        hidden = torch.tanh(body(emb(ids)))
        if chunked:
            loss = causal_lm_loss(hidden, emb.weight, None, labels, chunk_rows=5)
        else:
            loss = hf_loss(F.linear(hidden, emb.weight), labels, V)
        loss.backward()
        head_grad = None if emb.weight.grad is None else emb.weight.grad.clone()
        return loss.detach(), body.weight.grad.clone(), head_grad

    ref, got = run(False), run(True)
    for a, r in zip(got, ref):
        _close(a, r)
    emb.weight.requires_grad_(False)  # frozen tied head: only the body trains
    ref, got = run(False), run(True)
    assert got[2] is None and ref[2] is None
    for a, r in zip(got[:2], ref[:2]):
        _close(a, r)


@pytest.mark.parametrize("frozen_head", [False, True])
def test_all_ignored_labels_give_nan_loss_and_zero_gradients_like_hf(frozen_head):
    hidden, weight, b, labels = _setup()
    weight.requires_grad_(not frozen_head)
    labels = torch.full_like(labels, -100)
    labels[:, 0] = 5  # position 0's label is never predicted (the shift): still nothing to learn
    ref = hf_loss(F.linear(hidden, weight, b), labels, V)
    got = causal_lm_loss(hidden, weight, b, labels)
    assert torch.isnan(ref) and torch.isnan(got)
    for a, r in zip(_grads(got, [hidden, weight, b]), _grads(ref, [hidden, weight, b])):
        assert torch.equal(a, torch.zeros_like(a)) and torch.equal(r, torch.zeros_like(r))


@pytest.mark.parametrize("where", ["ignored_row", "labelled_row", "weight", "bias", "grad"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("trainable", ["all", "head_frozen", "input_frozen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_reaches_every_gradient_as_in_hf(where, value, trainable, dtype):
    """Wherever ForCausalLMLoss(lm_head(hidden))'s gradients are NaN/Inf, slimfit's are too (issue #30).
    Lost before: a row of logits holding +Inf or only -Inf has a NaN log-softmax in PyTorch, while
    torch.logsumexp gives ±Inf and left finite gradient entries; and on the CPU a row whose label is
    ignored was dropped before the head GEMM even when it, the weight or the bias held a NaN/Inf
    (PyTorch's gradient there is 0 · NaN: its dx row and every entry of dW are NaN)."""
    hidden, weight, b, labels = _setup()
    hidden, weight, b = (t.detach().to(dtype) for t in (hidden, weight, b))
    grad_loss = torch.tensor(value if where == "grad" else 1.5)
    if where == "ignored_row":  # labels[0, :5] are ignored; position 3 predicts labels[0, 4]
        hidden[0, 3, 7] = value
    elif where == "labelled_row":
        hidden[1, 6, 7] = value
    elif where in ("weight", "bias"):
        (weight[11] if where == "weight" else b)[2] = value
    grads = []
    for fn in (lambda h, w, c: hf_loss(F.linear(h, w, c), labels, V), lambda h, w, c: causal_lm_loss(h, w, c, labels)):
        h = hidden.clone().requires_grad_(trainable != "input_frozen")
        w, c = (t.clone().requires_grad_(trainable != "head_frozen") for t in (weight, b))
        grads.append(torch.autograd.grad(fn(h, w, c), [t for t in (h, w, c) if t.requires_grad], grad_loss))
    assert not nonfinite_missed(grads[1], grads[0])


@pytest.mark.parametrize("rows", ["ignored_dropped", "every_row_computed"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("trainable", ["all", "head_frozen", "input_frozen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_loss_gradient_leaves_no_entry_finite(rows, value, trainable, dtype, monkeypatch):
    """A NaN/Inf incoming gradient makes every gradient entry NaN/Inf, the rows whose label is ignored
    included (0 · grad): PyTorch's GEMMs may spread it to any entry (oneDNN's AMX bf16 matmul can leak NaN
    into rows of zeros when K, here the vocabulary, is not a multiple of 32: uxlfoundation/oneDNN#5717),
    and a finite entry would hide the overflow from AMP's GradScaler. every_row_computed: the path of
    accelerators (the CPU drops the finite ignored rows before the head GEMM)."""
    if rows == "every_row_computed":
        module = importlib.import_module("slimfit.autograd.linear_cross_entropy")
        monkeypatch.setattr(module, "_ignored_rows_finite", lambda *args: torch.tensor(False))
    hidden, weight, b, labels = _setup()
    h, w, c = (t.detach().to(dtype) for t in (hidden, weight, b))
    h.requires_grad_(trainable != "input_frozen")
    w.requires_grad_(trainable != "head_frozen"), c.requires_grad_(trainable != "head_frozen")
    needed = [t for t in (h, w, c) if t.requires_grad]
    grads = torch.autograd.grad(causal_lm_loss(h, w, c, labels), needed, torch.tensor(value))
    for i, g in enumerate(grads):
        assert not torch.isfinite(g).any(), f"gradient {i}: {int(torch.isfinite(g).sum())} finite entries"


def test_bf16_autocast_error_within_twice_pytorchs_own():
    hidden, weight, b, labels = _setup()
    exact = hf_loss(F.linear(hidden, weight, b), labels, V)
    exact_g = _grads(exact, [hidden, weight, b])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = hf_loss(F.linear(hidden, weight, b), labels, V)
        got = causal_lm_loss(hidden, weight, b, labels, chunk_rows=7)
    assert got.dtype == torch.float32
    assert abs(got.item() - exact.item()) <= 2 * abs(ref.item() - exact.item()) + 1e-6
    for a, r, e in zip(_grads(got, [hidden, weight, b]), _grads(ref, [hidden, weight, b]), exact_g):
        assert a.dtype == e.dtype
        assert rel_err(a, e) <= 2 * rel_err(r, e) + 1e-6


def test_bf16_weights_error_within_twice_pytorchs_own():
    """A head held in bf16 (no autocast): the weight gradient is formed a vocabulary block at a time with fp32
    sums over the chunks of rows, so its error against the fp32 answer stays within twice PyTorch's own."""
    hidden, weight, b, labels = _setup()
    exact = hf_loss(F.linear(hidden, weight, b), labels, V)
    exact_g = _grads(exact, [hidden, weight, b])
    half = [t.detach().bfloat16().requires_grad_() for t in (hidden, weight, b)]
    ref = hf_loss(F.linear(*half), labels, V)
    got = causal_lm_loss(*half, labels, chunk_rows=4)  # 39 rows in 10 chunks, 101 classes in 7 blocks
    for a, r, e in zip(_grads(got, half), _grads(ref, half), exact_g):
        assert a.dtype == torch.bfloat16
        assert rel_err(a.float(), e) <= 2 * rel_err(r.float(), e) + 1e-6


class _Head(torch.nn.Module):
    def __init__(self, vocab, hidden_size, dtype):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter((torch.randn(vocab, hidden_size, generator=g) / 8).to(dtype))

    def forward(self, hidden, labels):
        return causal_lm_loss(hidden, self.weight, None, labels, chunk_rows=32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_holds_no_vocab_wide_fp32_accumulator(dtype):
    """The step's peak beyond the head and its gradient is a few chunks' worth, not a (vocab, hidden) fp32
    sum nor a vocab-wide product per chunk (0.8 GiB at a 152k vocabulary, hidden 896, in bf16)."""
    from slimfit.memory import measure_step

    vocab, hidden_size, rows = 4096, 256, 128   # (vocab, hidden) fp32: 8 chunks of logits, as at a real LLM's 3.5
    head = _Head(vocab, hidden_size, dtype)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(1, rows, hidden_size, generator=g).to(dtype), torch.randint(0, vocab, (1, rows), generator=g))
    run = measure_step(head, batch)
    head_bytes = head.weight.numel() * head.weight.element_size()
    chunk = 32 * vocab * 4   # one chunk's fp32 logits
    assert run.total - run.resident <= head_bytes + 4 * chunk, (run.total - run.resident, head_bytes, chunk)


def _saved_numels(fn):
    numels = []

    def pack(t):
        numels.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return numels


def test_no_rows_by_vocab_tensor_is_saved_and_bytes_are_the_formula():
    hidden, weight, b, labels = _setup(bias=False)
    rows = B * S
    ref_numels = _saved_numels(lambda: hf_loss(F.linear(hidden, weight), labels, V))
    assert max(ref_numels) >= rows * V  # the check below can fail: the reference keeps the logits
    assert max(_saved_numels(lambda: causal_lm_loss(hidden, weight, None, labels))) < rows * V

    valid = int((F.pad(labels, (0, 1), value=-100)[:, 1:] != -100).sum())
    # trainable head: the kept rows (fp32), their logsumexp (fp32), labels (int64), the denominator,
    # and index_select's index (int64) of the kept rows (CPU: ignored rows are dropped)
    run = measure(lambda: causal_lm_loss(hidden, weight, None, labels), backward=True, exclude=(weight,))
    assert run.total == valid * (H * 4 + 4 + 8) + 4 + valid * 8
    # frozen head: only the input gradient (as many bytes as the kept rows) and the index
    weight.requires_grad_(False)
    run = measure(lambda: causal_lm_loss(hidden, weight, None, labels), backward=True, exclude=(weight,))
    assert run.total == valid * H * 4 + valid * 8


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.matmul):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_frozen_head_backward_runs_no_matmul():
    hidden, weight, b, labels = _setup()
    weight.requires_grad_(False), b.requires_grad_(False)
    loss = causal_lm_loss(hidden, weight, b, labels, chunk_rows=8)
    with _CountMatmuls() as counter:
        loss.backward()
    assert counter.count == 0
    weight.requires_grad_(True)
    loss = causal_lm_loss(hidden, weight, b, labels, chunk_rows=8)
    with _CountMatmuls() as counter:
        loss.backward()
    assert counter.count > 0  # trainable: logits recomputed, weight gradient formed


def test_bad_arguments_are_named():
    hidden, weight, b, labels = _setup()
    bad = labels.clone()
    bad[1, 3] = V
    with pytest.raises(ValueError, match=f"label {V} is outside"):
        causal_lm_loss(hidden, weight, b, bad)
    with pytest.raises(TypeError, match="integer tensor"):
        linear_cross_entropy(hidden, weight, b, labels.float())
    with pytest.raises(ValueError, match="leading shape"):
        linear_cross_entropy(hidden, weight, b, labels[:, :-1])
    with pytest.raises(ValueError, match="do not match"):
        linear_cross_entropy(hidden[..., :-1], weight, b, labels)
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_cross_entropy(hidden, weight, b, labels, chunk_rows=0)
    with pytest.raises(ValueError, match="num_items_in_batch must be one number"):
        linear_cross_entropy(hidden, weight, b, labels, num_items_in_batch=torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="different devices .*weight on meta.*move them to one device"):
        linear_cross_entropy(hidden, weight.detach().to("meta"), None, labels)
    with pytest.raises(RuntimeError, match="double backward"):
        loss = linear_cross_entropy(hidden, weight, b, labels)
        (g,) = torch.autograd.grad(loss, hidden, create_graph=True)
        g.sum().backward()


@pytest.mark.parametrize("trainable", ["all", "head_frozen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_final_softcapping_as_gemma2(trainable, dtype):
    """softcap=c: the loss of c · tanh(logits / c) computed as Gemma2's forward does (in the input dtype, then
    the fp32 upcast), with its gradients: equal to PyTorch's on the capped logits (fp32 within summation
    order, bf16 within twice PyTorch's own bf16 error against fp32)."""
    hidden, weight, b, labels = _setup()
    cap = 3.0

    def reference(h, w, c):
        logits = F.linear(h, w, c)
        return hf_loss(torch.tanh(logits / cap) * cap, labels, V)

    grads = []
    for fn in (reference, lambda h, w, c: causal_lm_loss(h, w, c, labels, softcap=cap, chunk_rows=5)):
        h = hidden.detach().to(dtype).requires_grad_(True)
        w, c = (t.detach().to(dtype).requires_grad_(trainable != "head_frozen") for t in (weight, b))
        loss = fn(h, w, c)
        grads.append((loss.detach(), torch.autograd.grad(loss, [t for t in (h, w, c) if t.requires_grad])))
    (ref_loss, ref_grads), (loss, got) = grads
    if dtype == torch.float32:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        for a, r in zip(got, ref_grads):
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-7)
        return
    exact = reference(*(t.detach().double() for t in (hidden, weight, b)))
    assert abs(float(loss) - float(exact)) <= 2 * abs(float(ref_loss) - float(exact)) + 1e-3


def test_softcap_option_checked():
    hidden, weight, b, labels = _setup()
    for bad in (0.0, -1.0, float("inf"), True, "30"):
        with pytest.raises(ValueError, match="softcap"):
            causal_lm_loss(hidden, weight, b, labels, softcap=bad)


def test_softcap_saves_what_the_uncapped_loss_saves():
    """Soft-capping adds no saved tensor: the tanh slope is recomputed per chunk in backward (the bytes are
    the formula of test_no_rows_by_vocab_tensor_is_saved_and_bytes_are_the_formula)."""
    hidden, weight, b, labels = _setup(bias=False)
    valid = int((F.pad(labels, (0, 1), value=-100)[:, 1:] != -100).sum())
    run = measure(lambda: causal_lm_loss(hidden, weight, None, labels, softcap=3.0), backward=True,
                  exclude=(weight,))
    assert run.total == valid * (H * 4 + 4 + 8) + 4 + valid * 8
    weight.requires_grad_(False)
    run = measure(lambda: causal_lm_loss(hidden, weight, None, labels, softcap=3.0), backward=True,
                  exclude=(weight,))
    assert run.total == valid * H * 4 + valid * 8


def test_chunk_rows_shrink_at_a_large_vocabulary():
    """A chunk holds at most CHUNK_LOGIT_ELEMENTS logits (at least MIN_CHUNK_ROWS rows, never more than asked)."""
    from slimfit.autograd.linear_cross_entropy import chunk_rows_for

    assert chunk_rows_for(256, 32000) == 256          # Llama-2's vocabulary: as asked
    assert chunk_rows_for(256, 151936) == 55          # Qwen2.5's: 32 MiB of fp32 logits a chunk
    assert chunk_rows_for(256, 10**7) == 16           # the floor
    assert chunk_rows_for(8, 10**7) == 8              # never more than asked


def test_large_vocabulary_chunks_and_blocks_give_the_same_loss_and_gradients(monkeypatch):
    """Fewer rows a chunk (a vocabulary past the logit cap) and small fp32 block sums of a bf16 head's gradient
    (the block cap forced low): the loss and gradients as the reference's."""
    lce = importlib.import_module("slimfit.autograd.linear_cross_entropy")
    monkeypatch.setattr(lce, "CHUNK_LOGIT_ELEMENTS", 4 * V)  # 4 rows a chunk at V classes
    hidden, weight, b, labels = _setup()
    ref = hf_loss(F.linear(hidden, weight, b), labels, V)
    got = causal_lm_loss(hidden, weight, b, labels, chunk_rows=256)
    _close(got, ref)
    for a, r in zip(_grads(got, [hidden, weight, b]), _grads(ref, [hidden, weight, b])):
        _close(a, r)
    half = [t.detach().bfloat16().requires_grad_() for t in (hidden, weight, b)]
    unbounded = _grads(causal_lm_loss(*half, labels, chunk_rows=4), half)
    monkeypatch.setattr(lce, "_BLOCK_SUM_ELEMENTS", 10 * H)  # 11 blocks of 10 classes, one sum reused
    bounded = _grads(causal_lm_loss(*half, labels, chunk_rows=4), half)
    for a, r in zip(bounded, unbounded):
        torch.testing.assert_close(a.float(), r.float(), rtol=0, atol=2 ** -8 * r.float().abs().max().item())
