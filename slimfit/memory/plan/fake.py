"""Running a whole training step on fake tensors: every op's output shapes, dtypes and storages are
computed (torch's FakeTensorMode, the meta kernels torch.compile traces with) and no data is allocated.

slimfit.memory.measure_step's tracker counts tensor storages at op boundaries; a fake storage has the same size
as the real one, so the tracker run over a fake step sees the bytes the real step allocates and frees, in
the same order. Where a fake run would go another way than the real one, `PlanMode` (a dispatch mode
between the tracker and the fake mode) keeps it on the real path:

  * the batch is fake too but for its labels (fake_batch: its shapes and dtypes from one real row, so a
    batch of any size costs next to nothing), and transformers reads its attention mask as the real step
    does (masks_read_as_data): transformers skips the mask when it masks nothing, but takes any fake tensor
    for a traced one and then builds the full mask; inside the fake run the mask is read as data, and the
    read of a fake boolean is answered True (below), as the planned batch's all-ones mask answers it. Ops
    without a fake input run for real: small factories without tensor inputs (a dropout seed drawn with
    torch.randint, then read on the host) are made for real;
  * the backend of scaled_dot_product_attention is chosen for real, on stand-ins of the same shapes: the
    fake kernel always picks the math backend, which materializes the attention matrix;
  * host reads of fake data: a boolean check is answered True (slimfit.patch's probes agree with the
    module's own forward, as they do for every family slimfit knows; the chunked LM loss finds the ignored
    rows finite, as they are in a healthy step); with numbers=True (building, the scheduler's step) a
    number is answered 0 (the scheduler's scores only pick the next step's frozen set); in the forward and
    backward any other read raises instead of being guessed. Weight initialisation is skipped (values).
"""
from __future__ import annotations

import contextlib
import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["SMALL_NUMEL", "new_fake_mode", "PlanMode", "is_fake", "fake_batch", "masks_read_as_data",
           "fake_parameters", "deepcopy_by_clone"]

SMALL_NUMEL = 4096


def new_fake_mode():
    """A FakeTensorMode that accepts real tensors as inputs (the batch, small real scalars)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(t) -> bool:
    """Whether t is a fake tensor (FakeTensorMode's)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


REAL_INPUTS = ("labels",)


def fake_batch(row: dict, batch: int, fake_mode, real: tuple = REAL_INPUTS) -> dict:
    """A batch of `batch` rows with the shapes and dtypes of `row` (a real batch of one row, every tensor's
    first dimension the batch): fake tensors (a prediction reads no values, and a real batch of a size that
    is being planned may not fit in memory), except the inputs named in `real`, the row repeated: the labels,
    which the losses check on the host (a label outside the vocabulary raises: a question a fake tensor cannot
    answer right) and which take 8 bytes a token or a sequence."""
    out = {k: v.repeat(batch, *([1] * (v.dim() - 1))) for k, v in row.items() if k in real}
    with fake_mode:
        out.update({k: torch.empty((batch, *v.shape[1:]), dtype=v.dtype) for k, v in row.items() if k not in real})
    return {k: out[k] for k in row}


@contextlib.contextmanager
def masks_read_as_data():
    """transformers does not take fake tensors for traced ones (its is_tracing) while this is active: its mask
    code then reads the fake attention mask as data (the read answered by PlanMode: it masks nothing) and skips
    the mask where the real step with its all-ones mask skips it, instead of building the full mask."""
    try:
        from transformers.utils import import_utils
    except ImportError:
        yield
        return
    original = import_utils.is_fake_tensor
    import_utils.is_fake_tensor = lambda x: False
    try:
        yield
    finally:
        import_utils.is_fake_tensor = original


def _deepcopy_fake(t, memo):
    """copy.deepcopy of a fake tensor: a fake clone, a Parameter again if it was one, its grad copied."""
    if id(t) in memo:
        return memo[id(t)]
    with torch.no_grad():
        new = t.clone()
    if isinstance(t, torch.nn.Parameter):
        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
    elif t.requires_grad:
        new.requires_grad_()
    if t.grad is not None:
        new.grad = copy.deepcopy(t.grad, memo)
    memo[id(t)] = new
    return new


@contextlib.contextmanager
def deepcopy_by_clone():
    """copy.deepcopy of fake tensors by clone while the planned step is built (peft deep-copies the head it
    trains beside LoRA, modules_to_save). torch's Tensor.__deepcopy__ deep-copies a tensor's __dict__, which for
    a fake tensor holds its FakeTensorMode: copying the mode's converters and caches corrupted the heap, and
    `slimfit plan --fit` segfaulted at its second LoRA prediction (bert-tiny: 5 runs in 5)."""
    from torch._subclasses.fake_tensor import FakeTensor

    had = "__deepcopy__" in FakeTensor.__dict__
    before = FakeTensor.__dict__.get("__deepcopy__")
    FakeTensor.__deepcopy__ = _deepcopy_fake
    try:
        yield
    finally:
        if had:
            FakeTensor.__deepcopy__ = before
        else:
            del FakeTensor.__deepcopy__


def fake_parameters(model, fake_mode) -> int:
    """Make every parameter of `model` that was made for real (a small one: SMALL_NUMEL) fake, tied ones once;
    how many were. A step mixes them with fake tensors in in-place updates (an optimizer's foreach step over
    pieces of several parameters), which the fake mode refuses for a real leaf that requires grad."""
    made: dict = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or is_fake(p):
                continue
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(fake_mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]
    return len(made)


def _small_fake(out) -> bool:
    """Whether every output is a fake tensor of at most SMALL_NUMEL elements."""
    flat = tree_flatten(out)[0]
    return bool(flat) and all(isinstance(t, torch.Tensor) and is_fake(t) and t.numel() <= SMALL_NUMEL for t in flat)


def _stand_in(t):
    """A real tensor with t's shape, dtype and last-dimension stride 1, holding one row (expanded)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if not isinstance(t, torch.Tensor) or not is_fake(t):
        return t
    with unset_fake_temporarily():
        return torch.empty(t.shape[-1] if t.dim() else 1, dtype=t.dtype, device=t.device).expand(t.shape)


def _sdp_choice(args, kwargs) -> int:
    """The backend torch's scaled_dot_product_attention picks, asked for real on stand-ins: it reads only
    shapes, dtypes, the last stride and the arguments."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    args = [_stand_in(a) for a in args]
    kwargs = {k: _stand_in(v) for k, v in kwargs.items()}
    with unset_fake_temporarily():
        return torch.ops.aten._fused_sdp_choice.default(*args, **kwargs)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def _autocast_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in: autocast's (it casts below F.scaled_dot_product_attention), else t's."""
    for device in ("cpu", "cuda"):
        if t.is_floating_point() and torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
    return t.dtype


def cuda_sdp_choice(args, kwargs) -> int:
    """The backend PyTorch's CUDA scaled_dot_product_attention picks on a Hopper/Ampere GPU, decided from
    shapes and arguments alone (a CPU machine cannot ask it): flash attention for fp16/bf16 without an
    additive mask, else the memory-efficient kernel (any float dtype, masks and dropout, but one key/value
    head per query head), else the math path, which keeps the S x S probabilities. Measured on an H200: a
    fp32 GQA model (SmolLM2) takes the math path, fp32 BERT with dropout the memory-efficient one."""
    from torch.nn.attention import SDPBackend

    given = dict(zip(_SDPA_ARGS, args), **kwargs)
    q, k, v, mask = given["query"], given["key"], given["value"], given.get("attn_mask")
    head_dim, dtype = q.shape[-1], _autocast_dtype(q)
    same_heads = q.dim() < 3 or k.shape[-3] == q.shape[-3]
    if q.dim() != 4 or k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        return int(SDPBackend.MATH)
    if dtype in (torch.float16, torch.bfloat16) and mask is None and head_dim <= 256:
        return int(SDPBackend.FLASH_ATTENTION)
    if dtype in (torch.float32, torch.float16, torch.bfloat16) and same_heads and head_dim % 8 == 0:
        return int(SDPBackend.EFFICIENT_ATTENTION)
    return int(SDPBackend.MATH)


@contextlib.contextmanager
def cuda_attention_backends():
    """F.scaled_dot_product_attention runs the backend CUDA would pick (cuda_sdp_choice) instead of the CPU's:
    the CPU takes its math path with dropout (BERT keeps S x S probabilities and a mask that CUDA's
    memory-efficient kernel never stores) and a fused path for fp32 GQA (CUDA's math path keeps them). Flash
    attention stays the CPU's own fused kernel, which saves what CUDA's flash saves (the output and the
    log-sum-exp). Inside a fake run only: nothing here computes real attention."""
    from torch.nn import functional as F
    from torch.nn.attention import SDPBackend

    original = F.scaled_dot_product_attention

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        choice = cuda_sdp_choice((query, key, value, attn_mask, dropout_p, is_causal), {"enable_gqa": enable_gqa})
        if choice != int(SDPBackend.MATH):  # the fused kernels take the autocast dtype, as autocast would give
            dtype = _autocast_dtype(query)
            query, key, value = (t.to(dtype) for t in (query, key, value))
        if choice == int(SDPBackend.EFFICIENT_ATTENTION):
            if attn_mask is not None and attn_mask.dtype == torch.bool:  # as CUDA's path converts it
                attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
            grad = any(t.requires_grad for t in (query, key, value)) and torch.is_grad_enabled()
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale)[0]
        if choice == int(SDPBackend.FLASH_ATTENTION) and dropout_p > 0 and key.shape[-3] == query.shape[-3]:
            # the CPU's fused kernel with dropout (fake tensors only: its shapes, what CUDA's flash keeps)
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=None, scale=scale)[0]
        if choice == int(SDPBackend.MATH):
            return torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

    patched = [(F, "scaled_dot_product_attention", attention)] + [
        (module, "fused_kernel", cuda_fused_kernel) for module in _fused_kernel_users()]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    for owner, name, value in patched:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _fused_kernel_users() -> list:
    """The modules that call autograd.fused_attention.fused_kernel by its name."""
    import importlib

    return [importlib.import_module(name) for name in ("slimfit.autograd.fused_attention",
                                                       "slimfit.patching.attention.hf_attention")]


def cuda_fused_kernel(q, k, v, attn_mask, dropout_p, is_causal):
    """slimfit's fused attention kernel choice (autograd.fused_attention.fused_kernel) as on a Hopper/Ampere
    GPU: flash attention for fp16/bf16 without a mask, else the memory-efficient kernel (K/V expanded for
    grouped queries, as slimfit's CUDA path does); head dims the kernels take unpadded only."""
    from ...autograd.fused_attention import fusable

    if not fusable(q, k, v, attn_mask, is_causal) or q.shape[-1] % 8 or v.shape[-1] % 8:
        return None
    half = _autocast_dtype(q) in (torch.float16, torch.bfloat16)
    return "cuda_flash" if half and attn_mask is None and q.shape[-1] <= 256 else "cuda_efficient"


def _all_selected(func, args, kwargs):
    """An op whose output size depends on data, answered as if every entry were selected (the largest
    output): `nonzero(x)` and `x[mask]` with a boolean mask. Others raise."""
    if func is torch.ops.aten.nonzero.default:
        x = args[0]
        return x.new_empty((x.numel(), x.dim()), dtype=torch.long)
    if func is torch.ops.aten.index.Tensor:
        x, indices = args[0], args[1]
        if len(indices) == 1 and indices[0] is not None and indices[0].dtype == torch.bool:
            mask = indices[0]
            return x.new_empty((mask.numel(), *x.shape[mask.dim():]))
    raise NotImplementedError(f"slimfit plan: {func} has an output size that depends on the data")


def _real_unless_grown(func, args, kwargs, flat):
    """An op without a fake input, run for real unless its output has many more elements than its largest
    input (GROWTH times, plus SMALL_NUMEL): then its fake output, which allocates nothing. Real inputs are the
    labels and the small weights and buffers made for real (a (2, 768) token-type embedding, its ids): the
    token-type embedding of a large batch was a real tensor of the activations' size. The shapes come from
    the op run on fake tensors first; an op the fake kernels cannot run (one that reads data) runs for real."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    limit = GROWTH * max(t.numel() for t in flat) + SMALL_NUMEL
    try:
        shaped = func(*args, **kwargs)   # the fake mode below this one: shapes only
    except Exception:  # noqa: BLE001 - data-dependent or not fakeable: the real op decides
        shaped = None
    outs = [t for t in tree_flatten(shaped)[0] if isinstance(t, torch.Tensor)]
    if shaped is not None and any(t.numel() > limit for t in outs):
        return shaped
    with unset_fake_temporarily():
        return func(*args, **kwargs)


GROWTH = 4


class PlanMode(TorchDispatchMode):
    """Keeps a fake run on the real run's path (module docstring). `numbers`: answer numeric host reads
    (0) and data-sized outputs (all selected); `on_op(func, args, kwargs, out)` sees every op; with
    `fake_mode`, the fake mode's memo of tensors is forgotten after every op (a parameter it remembers holds
    a weak reference, and `module.to()`, which swaps fake parameters, refuses such a tensor). `answered`
    counts the reads answered."""

    def __init__(self, numbers: bool = True, on_op=None, fake_mode=None):
        super().__init__()
        self.numbers, self.on_op, self.fake_mode = numbers, on_op, fake_mode
        self.answered = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Run the op on the real path where it would leave it (class docstring); answer the reads it can."""
        from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

        kwargs = kwargs or {}
        try:
            out = self._run(func, args, kwargs)
        except DynamicOutputShapeException:
            if not self.numbers:
                raise
            self.answered += 1
            out = _all_selected(func, args, kwargs)
        except DataDependentOutputException:
            out = self._answer(func, args)
            if out is None:
                raise
            self.answered += 1
            return out
        if self.fake_mode is not None:
            self.fake_mode.fake_tensor_converter.meta_converter.tensor_memo.clear()
        if self.on_op is not None:
            self.on_op(func, args, kwargs, out)
        return out

    def _run(self, func, args, kwargs):
        """The op, real when no input is fake (unless it grows them: _real_unless_grown) or a small factory,
        fake otherwise."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        if func is torch.ops.aten._fused_sdp_choice.default:
            return _sdp_choice(args, kwargs)
        flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if flat and not any(is_fake(t) for t in flat):
            return _real_unless_grown(func, args, kwargs, flat)
        out = func(*args, **kwargs)
        if not flat and _small_fake(out):
            with unset_fake_temporarily():
                out = func(*args, **kwargs)
        return out

    def _answer(self, func, args):
        """The answer to a read of fake data, None when this mode gives none."""
        if func is torch.ops.aten.equal.default:
            return True
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            if t.dtype == torch.bool:
                return True
            if self.numbers:
                return 0.0 if t.dtype.is_floating_point else 0
        return None


class OffDeviceHost:
    """FrozenState's transfer in a fake CPU run of a CUDA step with frozen_state="offload": the host copies go
    to the meta device, so the CPU tracker counts them as the GPU would (not at all), and come back as fake
    tensors of the same shape (a prediction reads no values)."""

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    def to_device(self, host: torch.Tensor, device):
        return torch.empty(host.shape, dtype=host.dtype, device=device), None

    def zeros_host(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    def piece_to_device(self, host: torch.Tensor, device) -> torch.Tensor:
        return torch.empty(host.shape, dtype=host.dtype, device=device)

    def piece_to_host_(self, host: torch.Tensor, t: torch.Tensor) -> None:
        pass

    def wait(self, ticket) -> None:
        pass

    def synchronize(self) -> None:
        pass
