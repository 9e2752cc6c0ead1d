"""Linear layer whose weight gradient is estimated from a sample of its input's token rows (WTA-CRS).

For x with N = prod(leading dims) token rows, dW = Σᵢ gᵢᵀ xᵢ is estimated without bias from
k = min(N, max(k_min, ceil(ratio·N))) kept rows (see `wta_crs.py` for the estimator), so the
activation saved for backward is k rows instead of N:

    saved: kept rows (k × in, compute dtype, or quantized to input_bits) + int32 row indices (k)
           + fp32 per-row scales (k)                 = k·in·e + 8k bytes (e = bytes per element)

* The forward output is exact (the same GEMM as `F.linear`); grad_input = g·W is exact (W is a
  parameter, not an activation); the bias gradient Σ g is exact (it needs no x).
* Probabilities pᵢ ∝ ‖xᵢ‖·‖gᵢ‖ with stale ‖gᵢ‖ from a `NormCache` when sample ids are given
  (backward writes this visit's norms), else pᵢ ∝ ‖xᵢ‖ alone.
* Frozen weight (`requires_grad` False), no sampling needed (k ≥ N) or no graph: exactly
  `slimfit.autograd.linear` (frozen: nothing saved; k ≥ N: the full input, or quantized).
* Draws use a `torch.Generator` seeded from `generator_seed` (or a side seed read from torch's
  default generator without advancing it, so `torch.manual_seed` makes runs repeatable and
  reentrant checkpointing keeps the dropout masks: slimfit/autograd/seeds.py); the seed is kept
  on ctx as an int. No host synchronisation in forward or backward (fixed k slots).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..kernels.validation import check_seed
from ._common import (
    autocast_dtype,
    backward_once,
    cast,
    check_bits,
    check_flag,
    check_float,
    check_group_size,
    check_same_device,
    check_same_dtype,
    compress_quantize,
    load,
    no_autocast,
    restore,
    save,
)
from .linear import input_grad, linear, record_linear_meta
from .norm_cache import NormCache, as_sample_ids
from .seeds import side_seed
from .wta_crs import SAMPLERS, check_ratio, num_kept_rows, sample_rows, sampling_probabilities

__all__ = ["sampled_linear"]


def _generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _nan_if_not_finite(t: torch.Tensor, dim=None) -> torch.Tensor:
    """0 where t (reduced over dim, or all of it) is finite, NaN where it holds a NaN or an Inf
    (max |t| propagates NaN and does not overflow for large finite values)."""
    m = t.abs().amax() if dim is None else t.abs().amax(dim=dim)
    return m.float() * 0.0


class _SampledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stale_g, k, sampler, seed, input_bits, group_size, stochastic,
                compute_dtype, norm_cache, sample_ids, check_finite=False):
        device_type = x.device.type
        with no_autocast(device_type):
            xc = x.to(compute_dtype)
            out = F.linear(xc, weight.to(compute_dtype), cast(bias, compute_dtype))
            x2 = xc.reshape(-1, xc.shape[-1])
            # norms of the input as given (not of its autocast copy): the draws depend on x and
            # the seed only, so a bf16-autocast run keeps the rows an fp32 run keeps
            x_norms = torch.linalg.vector_norm(x.reshape(-1, x.shape[-1]), dim=1, dtype=torch.float32)
            p = sampling_probabilities(x_norms, stale_g)
            rows = sample_rows(p, k, sampler, _generator(x.device, seed))
            kept = x2.index_select(0, rows.indices)
            # a NaN/Inf anywhere in x makes the exact dW non-finite; the sampled rows may miss it, so
            # the scales carry it (NaN when x is not finite, else unchanged; no host read, 0 bytes)
            scales = rows.scales * (1.0 + _nan_if_not_finite(x2))
            if input_bits is not None:
                kept = compress_quantize(kept, input_bits, group_size, stochastic, check_finite)
        need_x = ctx.needs_input_grad[0]
        save(ctx, weight if need_x else None, kept, rows.indices.to(torch.int32), scales)
        ctx.seed = seed
        ctx.k = k
        ctx.norm_cache = norm_cache      # a persistent per-layer store, not an activation
        ctx.sample_ids = sample_ids      # tuple of Python ints (or None)
        record_linear_meta(ctx, x, xc, weight, bias, device_type, compute_dtype)
        return out

    @staticmethod
    @backward_once("sampled_linear")
    def backward(ctx, grad_out):
        weight, kept, idx, scales = load(ctx)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        cd = ctx.compute_dtype
        grad_x = grad_w = grad_b = None
        with no_autocast(ctx.device_type):
            g = grad_out.to(cd)
            g2 = g.reshape(-1, g.shape[-1])
            if need_x:
                grad_x = input_grad(ctx, g2, weight)
            if need_w:
                xk = restore(kept, cd)
                gk = g2.index_select(0, idx.long())
                gk = (gk.float() * scales[:, None]).to(cd)
                grad_w = gk.t().mm(xk)
                # rows of g left out still reach dW when not finite (as in the exact gᵀx)
                grad_w = (grad_w + _nan_if_not_finite(g2, dim=0)[:, None]).to(ctx.w_dtype)
            if need_b:
                grad_b = g2.sum(0).to(ctx.b_dtype)
            if ctx.norm_cache is not None and ctx.sample_ids is not None:
                norms = torch.linalg.vector_norm(g2, dim=1, dtype=torch.float32)
                ids = torch.tensor(ctx.sample_ids, dtype=torch.int64)
                ctx.norm_cache.update(ids, norms.view(len(ctx.sample_ids), -1))
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None, None, None, None


def _check(x, weight, bias, ratio, k_min, sampler, input_bits, group_size, stochastic, check_finite,
           generator_seed, norm_cache, sample_ids) -> None:
    """Every argument of `sampled_linear` checked before anything runs, each error naming the problem."""
    op = "sampled_linear"
    check_float(op, "input", x)
    check_float(op, "weight", weight)
    check_float(op, "bias", bias)
    check_ratio(op, ratio, k_min)
    if sampler not in SAMPLERS:
        raise ValueError(f"slimfit.{op}: sampler must be one of {SAMPLERS}, got {sampler!r}")
    check_bits(op, "input_bits", input_bits, allow_none=True)
    check_group_size(op, group_size)
    check_flag(op, stochastic=stochastic, check_finite=check_finite)
    check_same_device(op, input=x, weight=weight, bias=bias)
    if generator_seed is not None:
        if isinstance(generator_seed, bool) or not isinstance(generator_seed, int):
            raise TypeError(f"slimfit.{op}: generator_seed must be an int or None, got {generator_seed!r}")
        check_seed(generator_seed, op)
    if norm_cache is not None and not isinstance(norm_cache, NormCache):
        raise TypeError(f"slimfit.{op}: norm_cache must be a slimfit NormCache, got {type(norm_cache).__name__}")
    if sample_ids is not None and norm_cache is None:
        raise ValueError(f"slimfit.{op}: sample_ids need a norm_cache (the layer's store of stale gradient norms)")
    if weight.dim() != 2:
        raise ValueError(
            f"slimfit.{op}: weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}"
        )
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"slimfit.{op}: mismatched shapes: input {tuple(x.shape)} has last dimension "
            f"{x.shape[-1] if x.dim() else None}, weight {tuple(weight.shape)} expects in_features={weight.shape[1]}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"slimfit.{op}: mismatched shapes: bias {tuple(bias.shape)} must be ({weight.shape[0]},)")


def sampled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ratio: float = 0.3,
    k_min: int = 10,
    sampler: str = "wta_crs",
    sample_ids=None,
    norm_cache: NormCache | None = None,
    input_bits: int | None = None,
    group_size: int = 128,
    stochastic: bool = False,
    generator_seed: int | None = None,
    check_finite: bool = False,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` whose backward estimates dW from k sampled token rows.

    ratio, k_min: k = min(N, max(k_min, ceil(ratio·N))) of the N = prod(x.shape[:-1]) rows are
        kept; ratio must be in (0, 1]. k = N (e.g. ratio=1) is exactly `linear`.
    sampler: 'wta_crs' (deterministic top rows + sampled residual; the default) or 'crs'
        (plain column-row sampling, for comparison).
    sample_ids, norm_cache: one id per entry of x's first dimension plus the layer's NormCache:
        pᵢ ∝ ‖xᵢ‖·(stale ‖gᵢ‖), and backward records this batch's ‖gᵢ‖. Without ids pᵢ ∝ ‖xᵢ‖
        (a cache given without ids is neither read nor written).
    input_bits, group_size, stochastic: the kept rows quantized as in `linear` (None: kept as is).
    generator_seed: seed of the row draws (default: a side seed read from torch's default generator).
    """
    op = "sampled_linear"
    _check(x, weight, bias, ratio, k_min, sampler, input_bits, group_size, stochastic, check_finite,
           generator_seed, norm_cache, sample_ids)
    batch = x.shape[0] if x.dim() >= 2 else 1
    ids = as_sample_ids(sample_ids, batch, op) if sample_ids is not None else None

    n = math.prod(x.shape[:-1])
    k = num_kept_rows(n, float(ratio), k_min)
    needs_graph = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if not needs_graph or not weight.requires_grad or k >= n:
        # frozen weight: nothing to estimate; k >= N: every row is kept, i.e. the exact linear
        return linear(x, weight, bias, input_bits=input_bits, group_size=group_size, stochastic=stochastic,
                      check_finite=check_finite)

    compute_dtype = autocast_dtype(x.device.type)
    if compute_dtype is None:
        check_same_dtype(op, input=x, weight=weight, bias=bias)
        compute_dtype = x.dtype
    stale = None
    if ids is not None:
        stale = norm_cache.lookup(ids, n // batch, x.device).reshape(n)
    seed = side_seed(op, tuple(x.shape), tuple(weight.shape)) if generator_seed is None else int(generator_seed)
    return _SampledLinear.apply(
        x, weight, bias, stale, k, sampler, seed, input_bits, group_size, bool(stochastic), compute_dtype,
        norm_cache if ids is not None else None, None if ids is None else tuple(ids.tolist()), bool(check_finite),
    )
