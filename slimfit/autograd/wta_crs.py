"""Row sampling for an unbiased estimate of a weight gradient dW = Σᵢ gᵢᵀ xᵢ (pure tensor logic).

The N token rows of a linear layer's input x (N × in) and of its output gradient g (N × out)
give dW = Σᵢ gᵢᵀ xᵢ, a sum of N rank-1 terms Aᵢ = gᵢᵀ xᵢ with ‖Aᵢ‖_F = ‖gᵢ‖·‖xᵢ‖. Keeping k < N
rows and reweighting them estimates dW without bias:

* CRS (column-row sampling): k draws j₁..j_k with replacement from p, each weighted 1/(k·p_j).
* WTA-CRS (winner-take-all CRS, arXiv 2305.15265): the |C| most probable rows are kept
  deterministically with weight 1; the other k − |C| draws come with replacement from the
  residual distribution p_j / (1 − P_C) over the rows outside C, each weighted
  (1 − P_C) / (p_j · (k − |C|)). |C| = argmin_{0 ≤ j < k} (1 − Σ_top-j p) / (k − j): the
  sampled part then has the smallest "residual mass per draw"; j = 0 is plain CRS, so the
  chosen |C| always satisfies P_C ≥ |C| / k (the paper's condition for a lower variance).

Unbiasedness needs p_j > 0 for every row whose term Aⱼ is non-zero; `sampling_probabilities`
guarantees it for every row with xᵢ ≠ 0. The ideal probabilities are pᵢ ∝ ‖xᵢ‖·‖gᵢ‖ (they
minimise CRS's variance); g is not known in the forward pass, so the caller passes a stale
estimate of ‖gᵢ‖ (or none: pᵢ ∝ ‖xᵢ‖). Stale norms change the variance only, never the bias.

Everything here has a fixed output shape (k slots) and no host synchronisation: |C| stays a
0-d tensor, slots below it hold the deterministic rows, the others the draws.

    p = sampling_probabilities(x_norms, g_norms)          # (N,) fp32, sums to 1
    s = wta_crs_sample(p, k, generator)                   # RowSample(indices, scales, num_deterministic)
    dW_hat = estimate_weight_grad(x, g, s)                # Σ_s scale_s · g_{i_s}ᵀ x_{i_s}
    expected_sq_error(x, g, p, k, "wta_crs")              # E‖dW_hat − dW‖²_F, exact (for tests/benchmarks)
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = [
    "SAMPLERS", "RowSample", "num_kept_rows", "check_ratio", "sampling_probabilities",
    "deterministic_set_size", "deterministic_count", "wta_crs_sample", "crs_sample", "sample_rows",
    "estimate_weight_grad", "expected_sq_error", "elementwise_variance", "projected_variance",
]

SAMPLERS = ("wta_crs", "crs")

# A row whose stale gradient norm is known to be ~0 (e.g. padding) still gets this fraction of
# the batch's mean stale norm, so its probability stays positive (unbiasedness does not rely on
# the stale norms being right).
G_FLOOR = 0.01


class RowSample(NamedTuple):
    indices: torch.Tensor           # (k,) int64 row indices (a row may repeat among the draws)
    scales: torch.Tensor            # (k,) fp32 weight of each slot
    num_deterministic: torch.Tensor  # 0-d int64: |C| (slots [0, |C|) are the deterministic rows)


# ---------------------------------------------------------------- sizes and checks
def check_ratio(op: str, ratio, k_min) -> None:
    """ratio a real number in (0, 1]; k_min an int >= 1 (errors name the argument)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise TypeError(f"slimfit.{op}: ratio must be a float in (0, 1], got {type(ratio).__name__} {ratio!r}")
    if not (0.0 < float(ratio) <= 1.0):  # also rejects NaN
        raise ValueError(
            f"slimfit.{op}: ratio must be in (0, 1] (the fraction of token rows kept for the weight "
            f"gradient), got {ratio!r}"
        )
    if isinstance(k_min, bool) or not isinstance(k_min, int) or k_min < 1:
        raise ValueError(f"slimfit.{op}: k_min must be an int >= 1, got {k_min!r}")


def num_kept_rows(n: int, ratio: float, k_min: int = 10) -> int:
    """k = min(N, max(k_min, ceil(ratio·N))) (ratio·N rounded up, float noise ignored)."""
    if n <= 0:
        return 0
    k = max(int(k_min), math.ceil(ratio * n - 1e-9 * n))
    return min(n, k)


# ---------------------------------------------------------------- probabilities
def sampling_probabilities(
    x_norms: torch.Tensor, g_norms: torch.Tensor | None = None, *, floor: float = G_FLOOR
) -> torch.Tensor:
    """pᵢ ∝ ‖xᵢ‖·ĝᵢ as fp32 summing to 1.

    g_norms: stale per-row estimates of ‖gᵢ‖ (same shape as x_norms), NaN where unknown, or None.
    Unknown rows get the mean of the known ones (so with none known, pᵢ ∝ ‖xᵢ‖ alone); known
    rows are floored at `floor` × that mean so that no row with xᵢ ≠ 0 has p = 0. If every known
    norm is 0 the estimates carry no information and pᵢ ∝ ‖xᵢ‖. If every xᵢ = 0 (dW = 0 whatever
    is kept) p is uniform.
    """
    a = x_norms.float()
    if g_norms is not None:
        g = g_norms.to(device=a.device, dtype=torch.float32)
        known = ~torch.isnan(g)
        gk = torch.where(known, g, torch.zeros((), device=a.device))
        mean = gk.sum() / known.sum().clamp_min(1)
        informative = mean > 0
        ghat = torch.where(known, gk.clamp_min(floor * mean), mean)
        ghat = torch.where(informative, ghat, torch.ones((), device=a.device))
        a = a * ghat
    total = a.sum()
    a = torch.where(total > 0, a, torch.ones((), device=a.device))
    return a / a.sum()


def _plan(p: torch.Tensor, k: int):
    """(top-k indices, top-k probabilities, |C| as a 0-d tensor, residual mass R = 1 − P_C)."""
    n = p.numel()
    if not (1 <= k <= n):
        raise ValueError(f"slimfit.wta_crs: k must be in [1, N={n}], got {k}")
    topv, topi = torch.topk(p, k, largest=True, sorted=True)
    in_top = torch.zeros(n, dtype=torch.bool, device=p.device).index_fill_(0, topi, True)
    rest = torch.where(in_top, torch.zeros((), device=p.device), p).sum()
    # residual[j] = mass outside the top j rows, summed directly (no 1 − cumsum cancellation)
    residual = torch.flip(torch.cumsum(torch.flip(topv, (0,)), 0), (0,)) + rest
    c = deterministic_set_size(residual, k)
    return topi, topv, c, residual.index_select(0, c.reshape(1)).squeeze(0)  # no host read of c


def deterministic_set_size(residual: torch.Tensor, k: int) -> torch.Tensor:
    """|C| = argmin_{0 ≤ j < k} residual[j] / (k − j), residual[j] = 1 − Σ_top-j p (first minimum)."""
    j = torch.arange(k, device=residual.device, dtype=residual.dtype)
    return torch.argmin(residual / (k - j))


def deterministic_count(p: torch.Tensor, k: int) -> int:
    """|C| that WTA-CRS would choose for probabilities p and k slots (a host read)."""
    return int(_plan(p, k)[2])


# ---------------------------------------------------------------- samplers
def wta_crs_sample(p: torch.Tensor, k: int, generator: torch.Generator | None = None) -> RowSample:
    """Winner-take-all column-row sampling of k slots from probabilities p (N,) (see module doc)."""
    topi, _, c, resid = _plan(p, k)
    slot = torch.arange(k, device=p.device)
    deterministic = slot < c
    # residual distribution: p with the rows of C removed (unnormalised; multinomial normalises)
    w = p.scatter(0, topi, torch.where(deterministic, torch.zeros((), device=p.device), p[topi]))
    has_rest = resid > 0
    # R = 0: C holds every row with p > 0 and the draws get weight 0; sample anything valid
    w = torch.where(has_rest, w, torch.ones((), device=p.device))
    draws = torch.multinomial(w, k, replacement=True, generator=generator)
    pd = p[draws]
    m = (k - c).to(torch.float32)
    sampled_scale = torch.where(has_rest & (pd > 0), resid / (pd * m).clamp_min(torch.finfo(torch.float32).tiny),
                                torch.zeros((), device=p.device))
    indices = torch.where(deterministic, topi, draws)
    scales = torch.where(deterministic, torch.ones((), device=p.device), sampled_scale)
    return RowSample(indices, scales.float(), c)


def crs_sample(p: torch.Tensor, k: int, generator: torch.Generator | None = None) -> RowSample:
    """Plain column-row sampling: k draws with replacement from p, weights 1/(k·p_j)."""
    if not (1 <= k <= p.numel()):
        raise ValueError(f"slimfit.wta_crs: k must be in [1, N={p.numel()}], got {k}")
    draws = torch.multinomial(p, k, replacement=True, generator=generator)
    scales = 1.0 / (k * p[draws])
    return RowSample(draws, scales.float(), torch.zeros((), dtype=torch.int64, device=p.device))


def sample_rows(p: torch.Tensor, k: int, sampler: str = "wta_crs",
                generator: torch.Generator | None = None) -> RowSample:
    if sampler == "wta_crs":
        return wta_crs_sample(p, k, generator)
    if sampler == "crs":
        return crs_sample(p, k, generator)
    raise ValueError(f"slimfit.wta_crs: sampler must be one of {SAMPLERS}, got {sampler!r}")


def estimate_weight_grad(x: torch.Tensor, g: torch.Tensor, sample: RowSample) -> torch.Tensor:
    """Σ_s scale_s · g_{i_s}ᵀ x_{i_s} for x (N × in), g (N × out): an (out × in) estimate of gᵀx."""
    idx = sample.indices.long()
    gs = g.index_select(0, idx).float() * sample.scales[:, None]
    return gs.t().mm(x.index_select(0, idx).float())


# ---------------------------------------------------------------- exact variances (tests, benchmarks)
def _parts(x, g, p, k, sampler):
    x, g, p = x.double(), g.double(), p.double()
    if sampler == "crs":
        outside = torch.ones(p.numel(), dtype=torch.bool, device=p.device)
        resid, m = torch.tensor(1.0, dtype=torch.float64), k
    elif sampler == "wta_crs":
        topi, _, c, _ = _plan(p.float(), k)
        c = int(c)
        outside = torch.ones(p.numel(), dtype=torch.bool, device=p.device)
        outside[topi[:c]] = False
        resid, m = p[outside].sum(), k - c
    else:
        raise ValueError(f"slimfit.wta_crs: sampler must be one of {SAMPLERS}, got {sampler!r}")
    xo, go, po = x[outside], g[outside], p[outside]
    a = go.norm(dim=1) * xo.norm(dim=1)
    if bool(((po == 0) & (a > 0)).any()):
        raise ValueError("slimfit.wta_crs: a row with a non-zero term has probability 0 (the estimator is biased)")
    inv = torch.where(po > 0, 1.0 / po.clamp_min(1e-300), torch.zeros_like(po))
    return xo, go, inv, a, resid, m


def expected_sq_error(x: torch.Tensor, g: torch.Tensor, p: torch.Tensor, k: int, sampler: str = "wta_crs") -> float:
    """E‖dW_hat − dW‖²_F of the estimator (exact): (R·Σ_{j∉C} ‖gⱼ‖²‖xⱼ‖²/pⱼ − ‖Σ_{j∉C} gⱼᵀxⱼ‖²_F)/(k − |C|)
    (CRS: C empty, R = 1)."""
    xo, go, inv, a, resid, m = _parts(x, g, p, k, sampler)
    w_rest = go.t().mm(xo)
    return float((resid * (a * a * inv).sum() - (w_rest * w_rest).sum()) / m)


def elementwise_variance(x: torch.Tensor, g: torch.Tensor, p: torch.Tensor, k: int,
                         sampler: str = "wta_crs") -> torch.Tensor:
    """Var(dW_hat[a, b]) for every element (float64, out × in):
    (R·Σ_{j∉C} g_ja² x_jb² / pⱼ − (Σ_{j∉C} g_ja x_jb)²) / (k − |C|)."""
    xo, go, inv, _, resid, m = _parts(x, g, p, k, sampler)
    second = (go * go * inv[:, None]).t().mm(xo * xo) * resid
    w_rest = go.t().mm(xo)
    return ((second - w_rest * w_rest) / m).clamp_min(0)


def projected_variance(x: torch.Tensor, g: torch.Tensor, p: torch.Tensor, k: int, sampler: str,
                       direction: torch.Tensor) -> float:
    """Var(⟨dW_hat, D⟩) for a fixed (out × in) direction D (exact): with tⱼ = ⟨gⱼᵀxⱼ, D⟩ = gⱼ·D·xⱼ,
    (R·Σ_{j∉C} tⱼ²/pⱼ − (Σ_{j∉C} tⱼ)²) / (k − |C|)."""
    xo, go, inv, _, resid, m = _parts(x, g, p, k, sampler)
    t = (go.mm(direction.double()) * xo).sum(dim=1)
    return float((resid * (t * t * inv).sum() - t.sum() ** 2) / m)
