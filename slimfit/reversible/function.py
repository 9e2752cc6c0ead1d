"""The MEFT coupling, its inverse, and one torch.autograd.Function over a stack of reversible layers.

    forward   y1 = λ·x1 + F(x2)          y2 = β·x2 + G(y1)
    inverse   x2 = (y2 − G(y1)) / β      x1 = (y1 − F(x2)) / λ
    gradients dy1' = dy1 + (∂G/∂y1)ᵀ dy2
              dx1 = λ·dy1'               dx2 = β·dy2 + (∂F/∂x2)ᵀ dy1'
              parameter grads of G from (G(y1), dy2), of F from (F(x2), dy1')

The stack's forward runs under no_grad and saves only its output pair (one tensor [a, b] of width
2d), the non-hidden inputs (attention mask, position ids) and the trainable parameters; the layer
seeds are Python ints on ctx. Backward walks the layers top-down, reconstructs each layer's inputs
from its outputs, re-runs G then F under enable_grad with their recorded seeds, and takes the
gradients of that one layer with torch.autograd.grad.

Dropout replay: every F and G call of a layer in training mode runs inside
`torch.random.fork_rng` with the CPU (and the tensor's CUDA device) generator reseeded from a seed
drawn once per call from torch's default generator. Re-running the call with the same seed redraws
exactly the same masks — the hidden dropouts, the adapter's dropout and the attention-probability
dropout inside SDPA/eager attention alike, without patching any of them — and the global RNG stream
only advances by the seed draws, identically in the reversible and the plain path.
"""
from __future__ import annotations

import contextlib

import torch
from torch.autograd.function import once_differentiable

from ..kernels.api import new_seed


@contextlib.contextmanager
def replay(seed: int | None, device: torch.device):
    """Run the body with the default generators of the CPU and of `device` seeded to `seed`,
    restoring the previous RNG state afterwards. seed=None: run as is (eval mode)."""
    if seed is None:
        yield
        return
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[], device_type="cpu"):
            torch.default_generator.manual_seed(seed)
            yield
        return
    index = device.index if device.index is not None else torch.get_device_module(device.type).current_device()
    mod = torch.get_device_module(device.type)
    with torch.random.fork_rng(devices=[index], device_type=device.type):
        torch.default_generator.manual_seed(seed)
        with mod.device(index):
            mod.manual_seed(seed)
        yield


def layer_seeds(layer: torch.nn.Module) -> tuple[int | None, int | None]:
    """Two seeds (for F and for G) in training mode, None in eval mode."""
    if not layer.training:
        return None, None
    return new_seed(), new_seed()


def combine(x: torch.Tensor, scale: float, branch: torch.Tensor) -> torch.Tensor:
    return x + branch if scale == 1.0 else scale * x + branch


def uncombine(y: torch.Tensor, scale: float, branch: torch.Tensor) -> torch.Tensor:
    return y - branch if scale == 1.0 else (y - branch) / scale


def run(plan, layer, which, x, attn_kwargs, seed, compute_dtype):
    """F or G of one layer on the stream tensor x, computed in `compute_dtype` (the model's), returned
    in the stream's dtype (they differ only with convert(..., stream_dtype=...))."""
    with replay(seed, x.device):
        out = plan.block(layer, which, x if x.dtype == compute_dtype else x.to(compute_dtype), attn_kwargs)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def coupling(plan, layer, x1, x2, attn_kwargs, seeds, compute_dtype):
    """One MEFT layer: (x1, x2) -> (y1, y2)."""
    form = plan.form
    y1 = combine(x1, form.lam, run(plan, layer, form.f, x2, attn_kwargs, seeds[0], compute_dtype))
    y2 = combine(x2, form.beta, run(plan, layer, form.g, y1, attn_kwargs, seeds[1], compute_dtype))
    return y1, y2


def _grad(output, inputs, grad_output):
    if not inputs or not output.requires_grad:
        return (None,) * len(inputs)
    return torch.autograd.grad(output, inputs, grad_output, allow_unused=True)


def inverse_step(plan, layer, y1, y2, dy1, dy2, attn_kwargs, seeds, params, compute_dtype, need_input_grad=True):
    """Reconstruct (x1, x2) from (y1, y2) and backpropagate (dy1, dy2) through one layer.
    Returns x1, x2, dx1, dx2 (None when not needed) and the gradients of `params`."""
    form = plan.form
    with torch.enable_grad():
        y1r = y1.detach().requires_grad_(True)
        g = run(plan, layer, form.g, y1r, attn_kwargs, seeds[1], compute_dtype)
    grads_g = _grad(g, (y1r, *params), dy2)
    with torch.no_grad():
        x2 = uncombine(y2, form.beta, g.detach())
    del g
    dy1_total = dy1 if grads_g[0] is None else dy1 + grads_g[0]
    with torch.enable_grad():
        x2r = x2.detach().requires_grad_(need_input_grad)
        f = run(plan, layer, form.f, x2r, attn_kwargs, seeds[0], compute_dtype)
    grads_f = _grad(f, ((x2r,) if need_input_grad else ()) + tuple(params), dy1_total)
    with torch.no_grad():
        x1 = uncombine(y1, form.lam, f.detach())
    del f
    dx1 = dx2 = None
    if need_input_grad:
        dx1 = dy1_total if form.lam == 1.0 else form.lam * dy1_total
        dx2 = dy2 if form.beta == 1.0 else form.beta * dy2
        if grads_f[0] is not None:
            dx2 = dx2 + grads_f[0]
        grads_f = grads_f[1:]
    param_grads = []
    for gg, gf in zip(grads_g[1:], grads_f):
        param_grads.append(gf if gg is None else (gg if gf is None else gg + gf))
    return x1, x2.detach(), dx1, dx2, param_grads


def split_tensors(kwargs: dict):
    """kwargs -> (static dict with tensor slots emptied, tensor names, tensors)."""
    static, names, tensors = {}, [], []
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            if v.requires_grad:
                raise NotImplementedError(
                    f"slimfit.reversible: the layer argument {k!r} requires grad; the reversible stack passes "
                    "non-hidden inputs through without gradients")
            names.append(k)
            tensors.append(v)
        else:
            static[k] = v
    return static, tuple(names), tensors


def join_tensors(static: dict, names, tensors) -> dict:
    out = dict(static)
    out.update(zip(names, tensors))
    return out


def swap_pair(form, y1, y2):
    """The next layer's (x1, x2) from this layer's (y1, y2)."""
    return (y2, y1) if form.swap else (y1, y2)


def unswap_pair(form, a, b):
    """This layer's (y1, y2) from the next layer's inputs (a, b)."""
    return (b, a) if form.swap else (a, b)


class ReversibleStack(torch.autograd.Function):
    """apply(plan, static, names, h, *tensors): layers plan.layers[:plan.n_rev] on [h, h];
    returns the pair [a, b] (width 2·d, in the stream dtype) that layer n_rev (or the output) takes."""

    @staticmethod
    def forward(ctx, plan, static, names, h, *tensors):
        n_kw = len(names)
        kw_tensors, params = tensors[:n_kw], tensors[n_kw:]
        attn_kwargs = join_tensors(static, names, kw_tensors)
        compute_dtype = h.dtype
        x1 = x2 = h if plan.stream_dtype in (None, h.dtype) else h.to(plan.stream_dtype)
        seeds, counts = [], []
        for i in range(plan.n_rev):
            layer = plan.layers[i]
            s = layer_seeds(layer)
            plan.record("forward", i, x1, x2)
            y1, y2 = coupling(plan, layer, x1, x2, attn_kwargs, s, compute_dtype)
            x1, x2 = swap_pair(plan.form, y1, y2)
            seeds.append(s)
            counts.append(len(plan.trainable(layer)))
        if sum(counts) != len(params):
            raise RuntimeError("slimfit.reversible: trainable parameters changed during the forward pass")
        out = torch.cat([x1, x2], dim=-1)
        ctx.save_for_backward(out, *kw_tensors, *params)
        ctx.plan, ctx.static, ctx.names, ctx.seeds, ctx.counts = plan, static, names, seeds, counts
        ctx.compute_dtype = compute_dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        plan, form = ctx.plan, ctx.plan.form
        n_kw = len(ctx.names)
        saved = ctx.saved_tensors
        out, kw_tensors, params = saved[0], saved[1:1 + n_kw], saved[1 + n_kw:]
        attn_kwargs = join_tensors(ctx.static, ctx.names, kw_tensors)
        a, b = out.chunk(2, dim=-1)
        da, db = dout.chunk(2, dim=-1)
        offsets = [0]
        for c in ctx.counts:
            offsets.append(offsets[-1] + c)
        grads = [None] * len(params)
        need_h = ctx.needs_input_grad[3]
        for i in reversed(range(len(ctx.seeds))):
            y1, y2 = unswap_pair(form, a, b)
            dy1, dy2 = unswap_pair(form, da, db)
            lp = params[offsets[i]:offsets[i + 1]]
            x1, x2, dx1, dx2, pg = inverse_step(plan, plan.layers[i], y1, y2, dy1, dy2, attn_kwargs,
                                                ctx.seeds[i], lp, ctx.compute_dtype, need_input_grad=(i > 0 or need_h))
            plan.record("backward", i, x1, x2)
            for j, gj in enumerate(pg):
                k = offsets[i] + j
                if gj is not None:
                    grads[k] = gj if grads[k] is None else grads[k] + gj
            a, b, da, db = x1, x2, dx1, dx2
        dh = (da + db).to(ctx.compute_dtype) if need_h else None
        return (None, None, None, dh, *([None] * n_kw), *grads)
