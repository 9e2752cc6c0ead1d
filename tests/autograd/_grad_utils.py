"""Shared helpers of the autograd tests: error metrics, BERT-like activations, byte formulas."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from slimfit.memory import measure

HIDDEN = 768
OUTLIER_CHANNELS = (77, 308, 588)  # BERT-base has a handful of large-magnitude hidden channels


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def cos_sim(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def bert_like_hidden(batch: int = 2, seq: int = 128, hidden: int = HIDDEN, seed: int = 0) -> torch.Tensor:
    """Post-LayerNorm hidden states shaped like BERT's: unit-variance rows sharing a mean
    direction, a few outlier channels (|x| up to ~10), LayerNorm affine near identity."""
    gen = torch.Generator().manual_seed(seed)
    e = torch.randn(batch, seq, hidden, generator=gen) * 0.5
    e = e + torch.randn(1, 1, hidden, generator=gen) * 0.3
    e[..., list(OUTLIER_CHANNELS)] += 6.0
    w = torch.rand(hidden, generator=gen) * 0.5 + 0.75
    b = torch.randn(hidden, generator=gen) * 0.05
    return F.layer_norm(e, (hidden,), w, b)


def nonfinite_missed(got, ref) -> list[str]:
    """Where PyTorch's gradient (ref) is NaN/Inf and slimfit's (got) is finite, per gradient (issue #30:
    a NaN where PyTorch has Inf is fine, a finite value where PyTorch is non-finite is not: AMP's
    GradScaler would not see the overflow). Empty when every non-finite entry stayed visible."""
    out = []
    for i, (a, r) in enumerate(zip(got, ref)):
        assert a.shape == r.shape, (i, a.shape, r.shape)
        missed = (~torch.isfinite(r)) & torch.isfinite(a)
        if missed.any():
            out.append(f"gradient {i}: {int(missed.sum())} of {int((~torch.isfinite(r)).sum())} "
                       "non-finite entries came back finite")
    return out


def q_bytes(numel: int, bits: int, group_size: int = 128) -> int:
    """Bytes of a per-group quantized tensor: packed codes + fp32 scale and offset per group."""
    return math.ceil(numel * bits / 8) + 8 * math.ceil(numel / group_size)


def saved(fn, *args, **kwargs) -> int:
    return measure(fn, *args, backward=False, **kwargs).total


def quant_rel_err_theory(bits: int, range_in_sigmas: float = 5.2) -> float:
    """Relative rms error of nearest rounding for Gaussian data: a step of
    range/(2**bits - 1) gives a uniform error of rms step/sqrt(12). A group of 128 normal
    samples spans about +-2.6 sigma."""
    return range_in_sigmas / (2**bits - 1) / math.sqrt(12)


@pytest.fixture(autouse=True)
def single_thread():
    """These tests use small tensors; on a shared, loaded machine intra-op threads spend far
    more time waiting at barriers than computing (measured: 30 ms vs 7 us for a floor of 8k
    elements). Restored afterwards, so other test modules are unaffected."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
