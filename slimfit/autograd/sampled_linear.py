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
* Options: `SampledLinearOptions` (a `LinearOptions`, how kept rows are stored, plus ratio, k_min and
  the sampler), checked once when built; the ids, the layer's NormCache and the seed are per call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F

from ..kernels.validation import check_seed
from ._common import (
    backward_once,
    call_options,
    cast,
    check_float,
    check_same_device,
    compress_quantize,
    load,
    no_autocast,
    restore,
    save,
)
from .linear import LinearOptions, check_linear_shapes, input_grad, linear, linear_compute_dtype, record_linear_meta
from .norm_cache import NormCache, as_sample_ids
from .seeds import side_seed
from .wta_crs import SAMPLERS, check_ratio, num_kept_rows, sample_rows, sampling_probabilities

__all__ = ["sampled_linear", "SampledLinearOptions"]


@dataclass(frozen=True)
class SampledLinearOptions(LinearOptions):
    """A LinearOptions (how the kept rows are stored: full or quantized) plus the sampling: k =
    min(N, max(k_min, ceil(ratio·N))) of the N token rows kept, drawn by `sampler` ('wta_crs' or 'crs').
    A frozen weight or k >= N runs `linear` with these options (they are LinearOptions). Checked once."""

    op: ClassVar[str] = "sampled_linear"
    ratio: float = 0.3
    k_min: int = 10
    sampler: str = "wta_crs"

    def __post_init__(self):
        check_ratio(self.op, self.ratio, self.k_min)
        if self.sampler not in SAMPLERS:
            raise ValueError(f"slimfit.{self.op}: sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        super().__post_init__()
        object.__setattr__(self, "ratio", float(self.ratio))


class _Draw(NamedTuple):
    """One call's draw: k rows kept, the seed of the draws, and the layer's NormCache with the batch's
    sample ids (a tuple of Python ints), or None for both when no ids were given."""

    k: int
    seed: int
    norm_cache: NormCache | None
    sample_ids: tuple | None


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
    def forward(ctx, x, weight, bias, stale_g, options, draw, compute_dtype):
        device_type = x.device.type
        with no_autocast(device_type):
            xc = x.to(compute_dtype)
            out = F.linear(xc, weight.to(compute_dtype), cast(bias, compute_dtype))
            x2 = xc.reshape(-1, xc.shape[-1])
            # norms of the input as given (not of its autocast copy): the draws depend on x and
            # the seed only, so a bf16-autocast run keeps the rows an fp32 run keeps
            x_norms = torch.linalg.vector_norm(x.reshape(-1, x.shape[-1]), dim=1, dtype=torch.float32)
            p = sampling_probabilities(x_norms, stale_g)
            rows = sample_rows(p, draw.k, options.sampler, _generator(x.device, draw.seed))
            kept = x2.index_select(0, rows.indices)
            # a NaN/Inf anywhere in x makes the exact dW non-finite; the sampled rows may miss it, so
            # the scales carry it (NaN when x is not finite, else unchanged; no host read, 0 bytes)
            scales = rows.scales * (1.0 + _nan_if_not_finite(x2))
            if options.input_bits is not None:
                kept = compress_quantize(kept, options.input_bits, options.group_size, options.stochastic,
                                         options.check_finite)
        need_x = ctx.needs_input_grad[0]
        save(ctx, weight if need_x else None, kept, rows.indices.to(torch.int32), scales)
        ctx.seed = draw.seed
        ctx.k = draw.k
        ctx.norm_cache = draw.norm_cache      # a persistent per-layer store, not an activation
        ctx.sample_ids = draw.sample_ids      # tuple of Python ints (or None)
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
        return grad_x, grad_w, grad_b, None, None, None, None


def _check_call(op, x, weight, bias, generator_seed, norm_cache, sample_ids) -> None:
    """The per-call arguments of `sampled_linear` (the options are checked when built), each error naming
    the problem."""
    check_same_device(op, input=x, weight=weight, bias=bias)
    if generator_seed is not None:
        if isinstance(generator_seed, bool) or not isinstance(generator_seed, int):
            raise TypeError(f"slimfit.{op}: generator_seed must be an int or None, got {generator_seed!r}")
        check_seed(generator_seed, op)
    if norm_cache is not None and not isinstance(norm_cache, NormCache):
        raise TypeError(f"slimfit.{op}: norm_cache must be a slimfit NormCache, got {type(norm_cache).__name__}")
    if sample_ids is not None and norm_cache is None:
        raise ValueError(f"slimfit.{op}: sample_ids need a norm_cache (the layer's store of stale gradient norms)")
    check_linear_shapes(op, x, weight, bias)


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
    options: SampledLinearOptions | None = None,
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
    options: a SampledLinearOptions built once (a patched layer's), instead of its fields: not checked again.
    """
    op = "sampled_linear"
    for name, t in (("input", x), ("weight", weight), ("bias", bias)):
        check_float(op, name, t)
    options = call_options(SampledLinearOptions, options, ratio=ratio, k_min=k_min, sampler=sampler,
                           input_bits=input_bits, group_size=group_size, stochastic=stochastic,
                           check_finite=check_finite)
    _check_call(op, x, weight, bias, generator_seed, norm_cache, sample_ids)
    batch = x.shape[0] if x.dim() >= 2 else 1
    ids = as_sample_ids(sample_ids, batch, op) if sample_ids is not None else None

    n = math.prod(x.shape[:-1])
    k = num_kept_rows(n, options.ratio, options.k_min)
    needs_graph = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if not needs_graph or not weight.requires_grad or k >= n:
        # frozen weight: nothing to estimate; k >= N: every row is kept, i.e. the exact linear
        return linear(x, weight, bias, options=options)

    compute_dtype = linear_compute_dtype(op, x, weight, bias)
    stale = None
    if ids is not None:
        stale = norm_cache.lookup(ids, n // batch, x.device).reshape(n)
    seed = side_seed(op, tuple(x.shape), tuple(weight.shape)) if generator_seed is None else int(generator_seed)
    draw = _Draw(k, seed, norm_cache if ids is not None else None, None if ids is None else tuple(ids.tolist()))
    return _SampledLinear.apply(x, weight, bias, stale, options, draw, compute_dtype)
