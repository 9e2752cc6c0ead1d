"""How much a layer moved in the last optimizer step, for all trained layers at once.

Two scores:

``relative`` (default, SlimFit's)
    mean over entries of |(W_old - W_new) / W_old|, the mean relative update.
    Entries with W_old == 0 have no relative update; they are left out of the mean (the
    mean runs over the non-zero entries of W_old). A layer whose W_old is entirely zero
    scores +inf if it moved (so it stays trained) and 0 if it did not. The paper's code
    divides by zero there and gets NaN/Inf (a zero padding row of an embedding is enough).

``robust``
    ||W_new - W_old||_2 / ||W_old||_2, which does not blow up on near-zero weights.
    ||W_old|| == 0 gives +inf if the layer moved, else 0.

``absolute``
    mean over entries of |W_new - W_old|: how far each weight moved, not divided by its size.
    Under Adam/AdamW every entry moves by about lr x |m / sqrt(v)|, so this measures how
    consistently a layer's gradient points one way, the same scale for every kind of layer.
    The two scores above divide by the weights, so under Adam they rank layers mostly by
    weight magnitude: LayerNorm weights (about 1) and embeddings score far lower than
    linear weights and stay frozen (docs/fidelity.md, "Which layers are scheduled"). Experimental
    (SchedulerConfig.experimental.score): measured no better (docs/fidelity.md).

Cost: the reductions are multi-tensor (``torch._foreach_*``) over all trained layers of a
(device, dtype) group, in chunks that bound the temporary memory, and produce one small
tensor per device, moved to the host once per step: no per-layer sync. ``relative`` first
runs the plain formula (3 foreach ops, about 7 passes over the weights); only layers that
come back non-finite (some W_old == 0) are redone zero-aware, once: they are remembered
(``zero_flags``) and scored zero-aware directly from then on.
"""
from __future__ import annotations

import math
import weakref
from collections import defaultdict
from typing import Callable, Optional, Sequence

import torch

__all__ = ["SCORES", "BlockSums", "add_host_together", "compute_scores", "relative_scores",
           "relative_scores_masked", "robust_scores", "absolute_scores", "relative_scores_naive",
           "robust_scores_naive", "absolute_scores_naive"]

SCORES = ("relative", "robust", "absolute")

# At most this many elements per foreach call: bounds the temporaries (a few copies of the
# chunk) when many layers are trained, e.g. at freeze_rate=0.
DEFAULT_CHUNK_NUMEL = 1 << 25


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(idx: Sequence[int], numels: Sequence[int], limit: int):
    cur: list[int] = []
    n = 0
    for i in idx:
        if cur and n + numels[i] > limit:
            yield cur
            cur, n = [], 0
        cur.append(i)
        n += numels[i]
    if cur:
        yield cur


def _finish(num: torch.Tensor, den: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
    inf = torch.full_like(num, float("inf"))
    return torch.where(den > 0, num / den.clamp_min(1), torch.where(moved > 0, inf, torch.zeros_like(num)))


def relative_scores(olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor]) -> torch.Tensor:
    """Fast path: mean |(W_old - W_new) / W_old| over all entries (3 foreach ops, ~7 memory
    passes). Non-finite where some W_old == 0 (then use ``relative_scores_masked``)."""
    olds, news = _to_acc(olds, news)
    d = torch._foreach_sub(news, olds)
    torch._foreach_div_(d, olds)
    total = torch.stack(_l1(d))
    numel = torch.tensor([t.numel() for t in olds], dtype=total.dtype, device=total.device)
    return total / numel


def relative_scores_masked(olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor]) -> torch.Tensor:
    """Zero-aware path: entries with W_old == 0 are left out of the mean; a layer with
    W_old == 0 everywhere scores +inf if it moved, else 0 (~22 memory passes)."""
    olds, news = _to_acc(olds, news)
    d = torch._foreach_sub(news, olds)
    torch._foreach_abs_(d)                                   # |ΔW|
    moved = _l1(d)                                           # Σ|ΔW| (only to tell 0 from not)
    a = torch._foreach_abs(olds)                             # |W_old|
    s = torch._foreach_sign(a)                               # 1 where W_old != 0, else 0
    den = torch._foreach_neg(s)
    torch._foreach_add_(den, 1.0)                            # 1 - s: exactly 0 or 1
    torch._foreach_add_(den, a)                              # |W_old| exactly, or 1 where W_old == 0
    del a
    torch._foreach_mul_(d, s)                                # drop entries with W_old == 0
    torch._foreach_div_(d, den)                              # |ΔW| / |W_old|
    del den
    total = _l1(d)                                           # Σ over kept entries
    count = _l1(s)                                           # number of kept entries
    return _finish(torch.stack(total), torch.stack(count), torch.stack(moved))


def _l1(ts):
    """Per-tensor Σ|x|. CUDA reduces in a tree (accurate in fp32); the CPU fallback of
    foreach_norm accumulates fp32 serially (measurably off on a large embedding; docs/scheduler.md,
    "Cost of step()"), so on the CPU it accumulates in fp64."""
    if ts[0].device.type == "cpu" and ts[0].dtype != torch.float64:
        return list(torch._foreach_norm(ts, 1, dtype=torch.float64))
    return torch._foreach_norm(ts, 1)


def _l2(ts, acc):
    if ts[0].device.type == "cpu":
        acc = torch.float64
    if ts[0].dtype != acc:
        return torch._foreach_norm(ts, 2, dtype=acc)
    return torch._foreach_norm(ts, 2)


def _to_acc(olds, news):
    acc = _acc_dtype(olds[0].dtype)
    if acc != olds[0].dtype:  # bf16/fp16 weights: do the arithmetic in fp32
        return [t.to(acc) for t in olds], [t.to(acc) for t in news]
    return olds, news


def robust_scores(olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor]) -> torch.Tensor:
    """||W_new - W_old|| / ||W_old|| (3 foreach ops, ~5 memory passes)."""
    acc = _acc_dtype(olds[0].dtype)
    d = torch._foreach_sub(news, olds)
    num = torch.stack(_l2(d, acc))
    den = torch.stack(_l2(list(olds), acc))
    inf = torch.full_like(num, float("inf"))
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)),
                       torch.where(num > 0, inf, torch.zeros_like(num)))


def absolute_scores(olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor]) -> torch.Tensor:
    """mean |W_new - W_old| (2 foreach ops, ~3 memory passes)."""
    olds, news = _to_acc(olds, news)
    total = torch.stack(_l1(torch._foreach_sub(news, olds)))
    numel = torch.tensor([t.numel() for t in olds], dtype=total.dtype, device=total.device)
    return total / numel


_FNS = {"relative": relative_scores, "relative_masked": relative_scores_masked, "robust": robust_scores,
        "absolute": absolute_scores}


def compute_scores(kind: str, olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor],
                   chunk_numel: int = DEFAULT_CHUNK_NUMEL,
                   collective: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                   zero_flags: Optional[list] = None, refresh: bool = False,
                   impl: str = "auto") -> torch.Tensor:
    """Scores of layers ``i`` (``olds[i]`` the snapshot, ``news[i]`` the current weight) as a
    float64 CPU tensor of ``len(olds)`` entries, with one device-to-host copy per device.

    ``collective`` (torch.distributed) is applied to each device's score vector before
    its transfer, e.g. a broadcast from rank 0. ``refresh=True`` also copies ``news[i]``
    into ``olds[i]`` (the snapshot buffers) once the scores are taken.

    Two implementations (``impl``; ``auto`` picks by device):

    ``foreach`` (accelerators): layers grouped by (device, dtype), multi-tensor ops, one
        transfer. ``relative`` runs the plain formula, exact unless W_old has zeros; layers
        whose result comes back non-finite are recomputed zero-aware (a second transfer, in
        that step only) and flagged in ``zero_flags`` (one bool per layer, updated in place)
        so later steps use the zero-aware formula for them at once.
    ``blocked`` (CPU): each layer is walked in cache-sized blocks, every formula step and the
        snapshot refresh done on a block while it is in cache, sums accumulated in float64:
        one read of W_old and W_new (and one write of W_old) instead of a dozen passes. Zero
        entries are handled block by block, so no flags are needed.
    """
    _check_args(kind, olds, news, chunk_numel, zero_flags, impl)
    n = len(olds)
    out = torch.empty(n, dtype=torch.float64)
    if n == 0:
        return out
    flags = zero_flags if zero_flags is not None else [False] * n
    blocked = [i for i in range(n)
               if impl == "blocked" or (impl == "auto" and news[i].device.type == "cpu")]
    bset = set(blocked)
    rest = [i for i in range(n) if i not in bset]
    with torch.no_grad():
        if blocked:
            vals = torch.tensor([_blocked_score(kind, olds[i], news[i], refresh) for i in blocked],
                                dtype=torch.float64)
            if collective is not None:
                vals = collective(vals)
            out[torch.tensor(blocked, dtype=torch.long)] = vals
        if rest:
            o, w = [olds[i] for i in rest], [news[i] for i in rest]
            fl = [flags[i] for i in rest]
            out[torch.tensor(rest, dtype=torch.long)] = _foreach_scores(kind, o, w, fl, chunk_numel, collective)
            for j, i in enumerate(rest):
                flags[i] = fl[j]
            if refresh:
                _copy_groups(o, w)
    return out


def _check_args(kind, olds, news, chunk_numel, zero_flags, impl) -> None:
    """compute_scores' arguments, each named in the error: a pair whose tensors differ in shape would
    otherwise fail inside a multi-tensor op without saying which layer."""
    if kind not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {kind!r}")
    if impl not in ("auto", "foreach", "blocked"):
        raise ValueError(f"impl must be 'auto', 'foreach' or 'blocked', got {impl!r}")
    if len(olds) != len(news):
        raise ValueError(f"compute_scores: {len(olds)} snapshots (olds) for {len(news)} weights (news); pass one "
                         "snapshot per weight, in the same order")
    for i, (old, new) in enumerate(zip(olds, news)):
        if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor) or old.shape != new.shape:
            raise ValueError(f"compute_scores: layer {i}: the snapshot ({_described(old)}) and the weight "
                             f"({_described(new)}) "
                             "must be tensors of the same shape; the snapshot must be taken from that weight")
    if impl == "blocked" and any(t.device.type != "cpu" for t in news):
        raise ValueError("impl='blocked' is for CPU tensors")
    if isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel < 1:
        raise ValueError(f"chunk_numel must be an int >= 1 (elements per batched reduction), got {chunk_numel!r}")
    if zero_flags is not None and len(zero_flags) != len(olds):
        raise ValueError(f"compute_scores: zero_flags has {len(zero_flags)} entries for {len(olds)} layers (one bool "
                         "per layer)")


def _described(t) -> str:
    return f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _foreach_scores(kind: str, o: list, w: list, flags: list, chunk_numel: int, collective) -> torch.Tensor:
    """Scores by multi-tensor ops (accelerators). ``relative``: the plain formula, then layers that came back
    non-finite (some W_old == 0) again zero-aware, flagged in ``flags`` (updated in place) for later steps."""
    if kind != "relative":  # no zero-aware variant needed: robust guards its division, absolute has none
        return _run([kind] * len(o), o, w, chunk_numel, collective)
    vals = _run(["relative_masked" if f else "relative" for f in flags], o, w, chunk_numel, collective)
    redo = [j for j in range(len(o)) if not flags[j] and not math.isfinite(vals[j])]
    if redo:
        again = _run(["relative_masked"] * len(redo), [o[j] for j in redo], [w[j] for j in redo],
                     chunk_numel, collective)
        for k, j in enumerate(redo):
            vals[j] = again[k]
            flags[j] = True
    return vals


# Elements per block of the CPU path: W_old, W_new and one fp32 temporary of this size stay
# in a core's L2 cache (3 x 128 KiB), and ATen runs ops this small on one thread
# (at::internal::GRAIN_SIZE = 32768): no OpenMP fork/join per block, which on a busy machine
# cost more than the arithmetic.
BLOCK_NUMEL = 1 << 15
# Blocks reduced by one call (BlockSums.add_blocks): each block's sum is still its own, but a call's few ops
# and one host read cover this many, and its temporaries stay a few MiB (4 MiB of fp32 at 1 << 15).
ROWS_PER_CALL = 32


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)


class BlockSums:
    """One layer's score summed over its entries piece by piece, in order: ``add(old, new)`` with flat,
    contiguous pieces of W_old and W_new (any length), ``value()`` the score. The CPU path sums each piece
    in blocks of BLOCK_NUMEL, ROWS_PER_CALL blocks reduced by one call, with the sums on the host; given the
    pieces of a tensor in order, at offsets that are multiples of BLOCK_NUMEL, it adds the same blocks in
    the same order as one call over the whole tensor, so its score is that one bit for bit. Other devices
    keep the sums on the device (one piece at a time, no host sync until ``value()``)."""

    def __init__(self, kind: str, dtype: torch.dtype, host: bool = True):
        self.kind, self.acc, self.host = kind, _acc_dtype(dtype), host
        # relative: Σ|Δ/W_old|, #kept, Σ|Δ| ; robust: Σ Δ², Σ W_old², - ; absolute: Σ|Δ|, #entries, -
        self.total = self.count = self.moved = 0.0
        self._buf = None
        self._pending: list = []   # (DeviceBatch, index): device sums not yet read to the host

    def add(self, old: torch.Tensor, new: torch.Tensor) -> None:
        old, new = old.detach().reshape(-1), new.detach().reshape(-1)
        if not self.host:
            self._add_on_device(old, new)
            return
        # Under fake tensors (slimfit plan) the first call stands for all: the same temporaries, and a
        # large model's prediction does not walk millions of blocks whose numbers mean nothing there.
        step = BLOCK_NUMEL * ROWS_PER_CALL
        end = min(old.numel(), step) if _is_fake(old) else old.numel()
        for a in range(0, end, step):
            self.add_blocks(old[a:min(end, a + step)], new[a:min(end, a + step)])
        self._buf = None   # one call's buffer while the piece is walked, not kept until the scores are read

    def add_blocks(self, o: torch.Tensor, w: torch.Tensor) -> None:
        """Consecutive blocks of BLOCK_NUMEL entries (the last one may be shorter), sums on the host, each
        block's sums those of ``add_block`` and added in the same order: the full blocks reduced by one row
        reduction (a few ops and one host read for all of them, not a few per block)."""
        full = o.numel() // BLOCK_NUMEL
        cut = full * BLOCK_NUMEL
        if full:
            self._add_rows(o[:cut].view(full, BLOCK_NUMEL), w[:cut].view(full, BLOCK_NUMEL))
        if o.numel() > cut:
            self.add_block(o[cut:], w[cut:])

    def _add_rows(self, o: torch.Tensor, w: torch.Tensor) -> None:
        """Rows of BLOCK_NUMEL entries, each a block: its sum is the row's reduction (the same reduction as
        one block's), added to the host sums row by row, in order."""
        if self.acc != o.dtype:
            o, w = o.to(self.acc), w.to(self.acc)
        d = torch.sub(w, o)
        if self.kind == "relative":
            for r, blk in enumerate(torch.div(d, o, out=d).norm(1, dim=1, dtype=torch.float64).tolist()):
                if math.isfinite(blk):
                    self.total += blk
                    self.count += BLOCK_NUMEL
                else:   # zeros in W_old: redo this block zero-aware, in its own row of d
                    self._zero_aware(o[r], w[r], d[r])
        elif self.kind == "absolute":
            for blk in d.norm(1, dim=1, dtype=torch.float64).tolist():
                self.total += blk
                self.count += BLOCK_NUMEL
        else:
            for dn, on in zip(d.norm(dim=1).tolist(), o.norm(dim=1).tolist()):
                self.total += dn ** 2
                self.count += on ** 2

    def add_block(self, o: torch.Tensor, w: torch.Tensor) -> None:
        """One block (at most BLOCK_NUMEL entries), sums on the host."""
        if self.acc != o.dtype:
            o, w = o.to(self.acc), w.to(self.acc)
        if self._buf is None or self._buf.numel() < o.numel():
            self._buf = torch.empty(max(o.numel(), 1), dtype=self.acc, device=o.device)
        d = self._buf[: o.numel()]
        torch.sub(w, o, out=d)
        kind = self.kind
        if kind == "relative":
            blk = float(torch.div(d, o, out=d).norm(1, dtype=torch.float64))
            if math.isfinite(blk):
                self.total += blk
                self.count += d.numel()
            else:  # zeros in W_old: redo this block zero-aware
                self._zero_aware(o, w, d)
        elif kind == "absolute":
            self.total += float(d.norm(1, dtype=torch.float64))
            self.count += d.numel()
        else:  # (norms, not dot: dot goes to BLAS, which brings its own threads)
            self.total += float(d.norm()) ** 2
            self.count += float(o.norm()) ** 2

    def _add_block_sums(self, sums: list, o: torch.Tensor, w: torch.Tensor) -> None:
        """One block's reductions (add_host_together) added as add_block adds them."""
        if self.kind == "robust":
            self.total += sums[0] ** 2
            self.count += sums[1] ** 2
        elif self.kind == "absolute" or math.isfinite(sums[0]):
            self.total += sums[0]
            self.count += o.numel()
        else:  # zeros in W_old: redo this block zero-aware
            o, w = o.detach().reshape(-1), w.detach().reshape(-1)
            self._zero_aware(o.to(self.acc), w.to(self.acc))

    def _zero_aware(self, o: torch.Tensor, w: torch.Tensor, d: torch.Tensor | None = None) -> None:
        """One block of the relative score with zeros in W_old (already in the accumulation dtype): entries
        with W_old == 0 left out, the block's movement kept apart. ``d``: the block's scratch (overwritten), so
        the redo allocates nothing (a padding row of an embedding is all zeros: this runs at every step that
        scores it, and its temporaries would otherwise be the step's peak). Δ / W_old of an entry with W_old = 0
        is inf or NaN, set to 0 in place (so is a ratio that overflows fp32, |Δ| > 3e38 |W_old|); a NaN weight makes
        the score NaN, as it would without the redo."""
        d = torch.sub(w, o) if d is None else torch.sub(w, o, out=d)
        moved = float(d.norm(1))
        self.moved += moved
        self.count += float(torch.count_nonzero(o))
        if math.isnan(moved):   # a NaN weight, old or new: the layer's score is NaN (it keeps training)
            self.total += math.nan
            return
        self.total += float(torch.nan_to_num_(d.div_(o), nan=0.0, posinf=0.0, neginf=0.0).norm(1))

    def _add_on_device(self, o: torch.Tensor, w: torch.Tensor) -> None:
        BlockSums.add_together([(self, o, w)])

    @staticmethod
    def add_together(items) -> None:
        """``add(old, new)`` of each (sums, old, new) in ``items`` whose sums stay on the device (in order, one
        kind): the pieces' sums computed together (a DeviceBatch, a few multi-tensor ops for all of them) and
        read to the host once, when the first of them is asked for."""
        batch = DeviceBatch(items[0][0].kind, [(o.detach().reshape(-1).to(sm.acc), w.detach().reshape(-1).to(sm.acc))
                                               for sm, o, w in items])
        for j, (sm, _, _) in enumerate(items):
            sm._pending.append((batch, j))

    @staticmethod
    def add_block_sums_together(items) -> None:
        """Each (sums, block_sums, numel) in ``items`` (one kind): a piece's (3, blocks) sums as
        slimfit::adam_blockwise_ takes them while it steps the piece (reference_adam.block_score_sums), added
        to the layer's sums as ``add_together`` adds a piece (two ops for all, read with the other device sums)."""
        batch = DeviceBatch.of_block_sums(items[0][0].kind, [(b, n) for _, b, n in items])
        for j, (sm, _, _) in enumerate(items):
            sm._pending.append((batch, j))

    def sums(self) -> list[float]:
        """[total, count, moved] (what a mid-step checkpoint saves; ``restore`` puts them back)."""
        pending, self._pending = self._pending, []
        for batch, j in pending:
            total, count, moved = batch.part(j)
            self.total, self.count, self.moved = self.total + total, self.count + count, self.moved + moved
        return [float(v) for v in (self.total, self.count, self.moved)]

    def restore(self, sums) -> "BlockSums":
        self.total, self.count, self.moved = (float(v) for v in sums)
        self._pending = []
        return self

    def value(self) -> float:
        total, count, moved = self.sums()
        if self.kind == "absolute":
            return total / count if count > 0 else 0.0
        if self.kind == "relative":
            if count > 0:
                return total / count
            return math.inf if moved > 0 else 0.0
        if count > 0:
            return math.sqrt(total) / math.sqrt(count)
        return math.inf if total > 0 else 0.0


def add_host_together(items) -> None:
    """``sums.add(old, new)`` of each (sums, old, new) in ``items`` with host sums, in order, the same sums:
    pieces of one block at most (small parameters) are reduced together by multi-tensor ops (a few ops and
    one host read for all of them; each piece's block sum is the same reduction as alone, and every layer's
    sums are added in its pieces' order)."""
    small = [j for j, (_, o, _) in enumerate(items) if 0 < o.numel() <= BLOCK_NUMEL]
    sums = dict(zip(small, _block_sums_together([items[j] for j in small]))) if len(small) > 1 else {}
    for j, (sm, o, w) in enumerate(items):
        if j in sums:
            sm._add_block_sums(sums[j], o, w)
        else:
            sm.add(o, w)


def _block_sums_together(items) -> list:
    """Per (sums, old, new), its one block's reductions as add_block takes them: [|Δ/W_old|_1] (relative),
    [|Δ|_1] (absolute) or [|Δ|_2, |W_old|_2] (robust), host numbers."""
    kind = items[0][0].kind
    olds = [o.detach().reshape(-1).to(sm.acc) for sm, o, _ in items]
    d = torch._foreach_sub([w.detach().reshape(-1).to(sm.acc) for sm, _, w in items], olds)
    if kind == "relative":
        torch._foreach_div_(d, olds)
    if kind == "robust":
        norms = list(torch._foreach_norm(d, 2)) + list(torch._foreach_norm(olds, 2))
    else:
        norms = list(torch._foreach_norm(d, 1, dtype=torch.float64))
    vals = torch.stack([t.to(torch.float64) for t in norms]).tolist()
    k = len(items)
    return [[vals[j], vals[k + j]] if kind == "robust" else [vals[j]] for j in range(k)]


class DeviceBatch:
    """The sums of several pieces (of one layer each) on their device: per piece, the (total, count, moved)
    of its score kind (BlockSums), computed by multi-tensor ops over all the pieces at once (about a dozen
    launches for the batch, not a dozen per piece) and read to the host when the first of them is asked for
    (``part``), not during the optimizer step: then every batch not yet read is read with it, one transfer
    per device for all of a step's batches (one host sync per scheduler step, not one per optimizer call).
    Entries with W_old == 0 are left out of the relative score, as the host path's zero-aware blocks; sums
    accumulate in float64 output (fp32 partial sums on a GPU)."""

    def __init__(self, kind: str, pairs):
        olds, news = [o for o, _ in pairs], [w for _, w in pairs]
        f64 = torch.float64
        d = torch._foreach_sub(news, olds)
        self.numels = [float(o.numel()) for o in olds]
        self.kind, self._host = kind, None
        if kind == "relative":
            torch._foreach_abs_(d)                          # |ΔW|
            moved = torch._foreach_norm(d, 1, dtype=f64)
            a = torch._foreach_abs(olds)
            keep = torch._foreach_sign(a)                   # 1 where W_old != 0, else 0
            den = torch._foreach_neg(keep)
            torch._foreach_add_(den, 1.0)
            torch._foreach_add_(den, a)                     # |W_old|, or 1 where W_old == 0
            torch._foreach_mul_(d, keep)
            torch._foreach_div_(d, den)
            parts = [torch._foreach_norm(d, 1, dtype=f64), torch._foreach_norm(keep, 1, dtype=f64), moved]
        elif kind == "absolute":
            parts = [torch._foreach_norm(d, 1, dtype=f64)]
        else:
            torch._foreach_mul_(d, d)
            parts = [torch._foreach_norm(d, 1, dtype=f64), torch._foreach_norm(torch._foreach_mul(olds, olds), 1,
                                                                                dtype=f64)]
        self._vals = torch.stack([t for part in parts for t in part])
        _UNREAD.append(weakref.ref(self))

    @classmethod
    def of_block_sums(cls, kind: str, pieces) -> "DeviceBatch":
        """The batch of pieces whose per-block sums are made already: (block_sums, numel) each, block_sums the
        (3, blocks) rows (total, count, moved) of the kind. Each row's sum over its blocks is its norm-1 (every
        entry is >= 0, or NaN): one multi-tensor op for all, in float64."""
        self = cls.__new__(cls)
        self.kind, self._host, self.numels = kind, None, [float(n) for _, n in pieces]
        rows = [b[r] for r in range(3) for b, _ in pieces]
        self._vals = torch.stack(torch._foreach_norm(rows, 1, dtype=torch.float64))
        _UNREAD.append(weakref.ref(self))
        return self

    def part(self, j: int) -> tuple:
        """(total, count, moved) of piece ``j``, as host numbers."""
        if self._host is None:
            _read_unread()
        k, h = len(self.numels), self._host
        if self.kind == "relative":
            return h[j], h[k + j], h[2 * k + j]
        if self.kind == "absolute":
            return h[j], self.numels[j], 0.0
        return h[j], h[k + j], 0.0


# DeviceBatches whose sums are not read to the host yet (weakly: a batch nobody asks for is not kept).
_UNREAD: list = []


def _read_unread() -> None:
    """Every unread DeviceBatch's sums to the host: one concatenation and one transfer per device."""
    batches = [b for b in (r() for r in _UNREAD) if b is not None and b._host is None]
    _UNREAD.clear()
    by_device: dict = {}
    for b in batches:
        by_device.setdefault(b._vals.device, []).append(b)
    for same in by_device.values():
        # one copy to the host, then numbers (a device tensor's tolist reads it an element at a time)
        values = (torch.cat([b._vals for b in same]) if len(same) > 1 else same[0]._vals).cpu().tolist()
        at = 0
        for b in same:
            n = b._vals.numel()
            b._host, b._vals, at = values[at:at + n], None, at + n


def _blocked_score(kind: str, old: torch.Tensor, new: torch.Tensor, refresh: bool) -> float:
    if not (old.is_contiguous() and new.is_contiguous()):
        # rare (a transposed view as a parameter): plain formulas on whole tensors
        val = NAIVE_SCORES[kind](old, new)
        if refresh:
            old.copy_(new)
        return val
    o_all, n_all = old.detach().view(-1), new.detach().view(-1)
    sums = BlockSums(kind, old.dtype)
    step = BLOCK_NUMEL * ROWS_PER_CALL
    for a in range(0, o_all.numel(), step):
        sums.add_blocks(o_all[a:a + step], n_all[a:a + step])
        if refresh:
            o_all[a:a + step].copy_(n_all[a:a + step])
    return sums.value()


def _copy_groups(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, t in enumerate(dst):
        groups[(t.device, t.dtype)].append(i)
    for idx in groups.values():
        torch._foreach_copy_([dst[i] for i in idx], [src[i].detach() for i in idx])


def _run(kinds, olds, news, chunk_numel, collective) -> torch.Tensor:
    n = len(olds)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, t in enumerate(news):
        groups[(kinds[i], t.device, t.dtype)].append(i)
    numels = [t.numel() for t in news]
    per_device: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = defaultdict(list)
    with torch.no_grad():
        for (kind, dev, _), idx in sorted(groups.items(), key=lambda kv: kv[1][0]):
            for chunk in _chunks(idx, numels, chunk_numel):
                vals = _FNS[kind]([olds[i].detach() for i in chunk], [news[i].detach() for i in chunk])
                per_device[dev].append((chunk, vals.to(torch.float64)))
        out = torch.empty(n, dtype=torch.float64)
        for parts in per_device.values():
            vals = torch.cat([v for _, v in parts])
            if collective is not None:
                vals = collective(vals)
            vals = vals.cpu()                                 # the one transfer for this device
            pos = [i for c, _ in parts for i in c]
            out[torch.tensor(pos, dtype=torch.long)] = vals
    return out


# ----------------------------------------------------------------- specification (tests)
def relative_scores_naive(old: torch.Tensor, new: torch.Tensor) -> float:
    """The formula written plainly, one layer at a time (slow; for tests and docs)."""
    old, new = old.double(), new.double()
    keep = old != 0
    if keep.any():
        return ((old - new)[keep] / old[keep]).abs().mean().item()
    return float("inf") if (old != new).any() else 0.0


def robust_scores_naive(old: torch.Tensor, new: torch.Tensor) -> float:
    old, new = old.double(), new.double()
    den = old.norm()
    if den > 0:
        return ((new - old).norm() / den).item()
    return float("inf") if (old != new).any() else 0.0


def absolute_scores_naive(old: torch.Tensor, new: torch.Tensor) -> float:
    return (new.double() - old.double()).abs().mean().item()


NAIVE_SCORES = {"relative": relative_scores_naive, "robust": robust_scores_naive, "absolute": absolute_scores_naive}
