"""Reference of slimfit::adam_blockwise_: one Adam/AdamW step of pieces whose moments are held as 8-bit
block-wise dynamic codes, decoded, stepped and encoded again in one kernel.

The held step (slimfit/optim/held_step.py) otherwise decodes both moments of a call's pieces, runs torch's
multi-tensor Adam on them and encodes them back: about thirty ops a call, each a launch on a GPU, and two
fp32 temporaries the size of the call. This op is that whole round in one: every element is read and
written once, nothing but the codes, block maxima and weights is written.

Per piece j (a flat contiguous slice of a parameter; its moments' codes and block maxima the matching
slices of the held entries: the piece starts at a block boundary of its entries) and element i, in fp32,
every operation rounded on its own (no fused multiply-add), the scalars given as fp32 values:

    m = qmap_m[mc[i]] * am[b]            s = qmap_v[vc[i]] * av[b]; v = s * s      (b = i // block_size)
    g = grad[i] (to fp32)                w = param[i] (to fp32)
    weight_decay != 0: decoupled (AdamW)  w = w * decays[j]
                       else (Adam)        g = g + w * weight_decay
    m = m + (g - m) * (1 - beta1)
    v = v * beta2 + (g * g) * (1 - beta2)
    w = w - step_sizes[j] * (m / (sqrt(v) / bc2_sqrts[j] + eps))
    param[i] = w                      fp32 weights
             = w rounded to the weight's dtype, stochastically from (seeds[3j + 2], offsets[j] + i) with
               round_weights (reference.round_stochastic's formulas), else to nearest
    then per block of the new m and of s = sqrt(max(v, 0)): absmax, and each element's code of y = x *
    (1 / absmax) (0 for a zero or subnormal absmax) as reference.quantize_blockwise makes it: the nearest
    level, or with ``stochastic`` one of the two levels around y drawn from the uniform of (seeds[3j], offsets[j]
    + i) for m and (seeds[3j + 1], offsets[j] + i) for s.

With ``score`` (SCORE_KINDS: 1 relative, 2 robust, 3 absolute; 0 none) each piece j whose ``score_sums[j]`` is not
empty gets the sums of its blocks' scores (slimfit/scheduler/scores.py), so a scheduler reads how far the step
moved each layer without copying its old weights: with w0 the weight as loaded and w1 the weight as stored (after
its rounding, read back as fp32), d = w1 - w0, per block b (fp32, each block's terms summed by halving: the
second half of the block, zero-padded to block_size, added to the first, until one value is left)

    relative   score_sums[j][0, b] = sum of |d| * k / (|w0| + (1 - k)), k = 1 where w0 != 0 else 0
               score_sums[j][1, b] = sum of k; score_sums[j][2, b] = sum of |d|
    robust     score_sums[j][0, b] = sum of d * d; score_sums[j][1, b] = sum of w0 * w0; [2, b] = 0
    absolute   score_sums[j][0, b] = sum of |d|; score_sums[j][1, b] = the block's element count; [2, b] = 0

(1 - beta1) and (1 - beta2) are computed in double and rounded to fp32 once, as every scalar here; the caller
computes step_sizes = lr / (1 - beta1^t), bc2_sqrts = sqrt(1 - beta2^t) and decays = 1 - lr * weight_decay per
piece (t the step count after this step), as torch's Adam does on the host. The random stream is a function
of the element's index in the whole parameter (``offsets``: the piece's first element there), not of how
pieces are batched into calls: a sharded parameter's moments are coded the same at every world size.

The arithmetic is slimfit's own, not torch's (torch's CPU lerp and addcmul fuse multiply-adds on some CPUs):
one definition, which the C++ and Triton kernels follow bit for bit.
"""
from __future__ import annotations

import torch

from . import reference

__all__ = ["adam_blockwise_", "f32", "SCORE_KINDS", "block_score_sums"]

# score kinds of the op's ``score`` argument (0: the op computes no sums)
SCORE_KINDS = {"relative": 1, "robust": 2, "absolute": 3}


def f32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value (as a kernel's float argument holds it)."""
    return torch.tensor(float(x), dtype=torch.float32).item()   # beyond fp32's range: +-inf


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root (IEEE's, as C++'s std::sqrt and Triton's sqrt_rn give it): torch's
    CPU sqrt of fp32 is not always; the double root rounded once to fp32 is (double keeps more than twice
    fp32's bits, so the second rounding cannot differ)."""
    return torch.sqrt(x.double()).float()


def _decode(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor, block_size: int, n: int) -> torch.Tensor:
    return reference.dequantize_blockwise(codes, absmax, qmap, block_size, (n,), torch.float32)


def _encode_into(x: torch.Tensor, qmap: torch.Tensor, block_size: int, stochastic: bool, seed: int, start: int,
                 codes: torch.Tensor, absmax: torch.Tensor) -> None:
    """reference.quantize_blockwise of ``x`` with element i drawing index start + i, written into codes/absmax."""
    c, a = reference.quantize_blockwise_from(x, qmap, block_size, stochastic, seed, start)
    codes.copy_(c)
    absmax.copy_(a)


def _halving_sums(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per block of ``x`` (fp32, zero-padded to whole blocks): its sum by halving, the order the kernels take."""
    n = x.numel()
    nb = -(-n // block_size)
    t = torch.zeros(nb * block_size, dtype=torch.float32, device=x.device)
    t[:n] = x
    t = t.view(nb, block_size)
    h = block_size
    while h > 1:
        h //= 2
        t = t[:, :h] + t[:, h:2 * h]
    return t[:, 0]


def block_score_sums(kind: int, w0: torch.Tensor, w1: torch.Tensor, block_size: int) -> torch.Tensor:
    """The (3, blocks) score sums of a piece (the module docstring) from its weights before and after, fp32."""
    d = w1 - w0
    nb = -(-w0.numel() // block_size)
    out = torch.zeros(3, nb, dtype=torch.float32, device=w0.device)
    if kind == SCORE_KINDS["relative"]:
        k, a = (w0 != 0).to(torch.float32), d.abs()
        out[0] = _halving_sums((a * k) / (w0.abs() + (1.0 - k)), block_size)
        out[1], out[2] = _halving_sums(k, block_size), _halving_sums(a, block_size)
    elif kind == SCORE_KINDS["robust"]:
        out[0], out[1] = _halving_sums(d * d, block_size), _halving_sums(w0 * w0, block_size)
    else:
        out[0] = _halving_sums(d.abs(), block_size)
        out[1] = _halving_sums(torch.ones_like(w0), block_size)
    return out


def adam_blockwise_(params, grads, m_codes, m_absmax, v_codes, v_absmax, qmap_m, qmap_v, step_sizes, decays,
                    bc2_sqrts, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
                    block_size: int, stochastic: bool, seeds, offsets, round_weights: bool, score_sums=(),
                    score: int = 0) -> None:
    b1c, b2, b2c = f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2)
    eps, wd = f32(eps), f32(weight_decay)
    for j, p in enumerate(params):
        n = p.numel()
        if n == 0:
            continue
        flat = p.view(-1)
        m = _decode(m_codes[j], m_absmax[j], qmap_m, block_size, n)
        s = _decode(v_codes[j], v_absmax[j], qmap_v, block_size, n)
        v = s * s
        g = grads[j].reshape(-1).to(torch.float32)
        w = flat.to(torch.float32)
        w0 = w.clone() if score else w   # (w is the param itself when it is fp32)
        if wd != 0.0:
            if decoupled:
                w = w * f32(decays[j])
            else:
                g = g + w * wd
        m = m + (g - m) * b1c
        v = v * b2 + (g * g) * b2c
        w = w - f32(step_sizes[j]) * (m / (_sqrt(v) / f32(bc2_sqrts[j]) + eps))
        if flat.dtype == torch.float32:
            flat.copy_(w)
        elif round_weights:
            flat.copy_(reference.round_stochastic_from(w, flat.dtype, int(seeds[3 * j + 2]), int(offsets[j])))
        else:
            flat.copy_(w.to(flat.dtype))
        if score and score_sums[j].numel():
            score_sums[j].copy_(block_score_sums(score, w0, flat.to(torch.float32), block_size))
        start = int(offsets[j])
        _encode_into(m, qmap_m, block_size, stochastic, int(seeds[3 * j]), start, m_codes[j], m_absmax[j])
        _encode_into(_sqrt(v.clamp_min(0)), qmap_v, block_size, stochastic, int(seeds[3 * j + 1]), start,
                     v_codes[j], v_absmax[j])
