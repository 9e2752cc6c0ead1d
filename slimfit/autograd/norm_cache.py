"""Stale per-sample gradient norms for the sampling probabilities of `sampled_linear`.

WTA-CRS samples token row i with probability pᵢ ∝ ‖xᵢ‖·‖gᵢ‖, but gᵢ (the gradient of the layer's
output row) only exists in backward, after the rows had to be chosen. A `NormCache` belongs to one
linear layer and remembers, for every sample id it has seen, the norms ‖gᵢ‖ of that sample's rows
from its previous visit (the previous epoch); the forward pass of the next visit reads them back.

    cache = NormCache()                                  # one per linear layer
    y = sampled_linear(x, w, b, sample_ids=batch_ids, norm_cache=cache)   # reads stale norms
    y.backward(...)                                      # writes this visit's ‖gᵢ‖ for batch_ids

* Rows and ids: x has shape (B, *rows_per_sample, in) and sample_ids has B entries, one per
  entry of x's first dimension (the data loader's dataset indices); row r of sample b is the
  r-th of its prod(rows_per_sample) rows. A 2-D x (B, in) has one row per sample.
* Without ids (or the first time a sample is seen) nothing is known and pᵢ ∝ ‖xᵢ‖ alone: every
  row is assumed to have the same gradient norm. Rows of a batch whose sample is unknown while
  others are known get the mean known norm (see `wta_crs.sampling_probabilities`).
* `per_token=True` (default) keeps one norm per row, so the CLS token, punctuation and padding
  get their own probabilities; a sample seen with another length (dynamic padding) reuses its
  first min(old, new) positions and treats the rest as unknown (right padding keeps positions
  aligned). `per_token=False` keeps one mean norm per sample: B values instead of B·L.
* Storage is a dense table (capacity × width) on the layer's device, `dtype` bfloat16 by default
  (fp32 range: gradient norms of 1e-7 do not underflow as they would in fp16; 8 mantissa bits
  are plenty for a probability). NaN marks unknown entries. Memory: capacity·width·2 bytes per
  layer, e.g. 100k samples × 128 tokens = 24 MiB; use per_token=False or device="cpu" when that
  matters. Ids must be ints in [0, 2**31) (dataset indices, not hashes).
* Only the probabilities depend on these norms, never the bias of the estimate: stale, missing
  or wrong norms make the gradient noisier, not wrong.
"""
from __future__ import annotations

import torch

__all__ = ["NormCache", "as_sample_ids"]

_MAX_ID = 2**31


def as_sample_ids(sample_ids, batch: int, op: str = "sampled_linear") -> torch.Tensor:
    """Sample ids as a CPU int64 tensor of `batch` entries (errors name the problem)."""
    if isinstance(sample_ids, torch.Tensor):
        if sample_ids.dtype.is_floating_point or sample_ids.dtype.is_complex or sample_ids.dtype == torch.bool:
            raise TypeError(f"slimfit.{op}: sample_ids must be integers, got dtype {sample_ids.dtype}")
        ids = sample_ids.detach().reshape(-1).to("cpu", torch.int64)
    else:
        try:
            values = list(sample_ids)
        except TypeError:
            raise TypeError(f"slimfit.{op}: sample_ids must be a 1-D tensor or a sequence of ints, "
                            f"got {type(sample_ids).__name__}") from None
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise TypeError(f"slimfit.{op}: sample_ids must be a sequence of ints")
        ids = torch.tensor(values, dtype=torch.int64)
    if ids.numel() != batch:
        raise ValueError(
            f"slimfit.{op}: got {ids.numel()} sample_ids for a batch of {batch} (one id per entry of "
            "the input's first dimension)"
        )
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= _MAX_ID):
        raise ValueError(f"slimfit.{op}: sample_ids must be in [0, 2**31) (dataset indices), got "
                         f"min {int(ids.min())}, max {int(ids.max())}")
    return ids


class NormCache:
    """Stale ‖gᵢ‖ of one linear layer's output-gradient rows, keyed by sample id (see module doc)."""

    def __init__(self, *, per_token: bool = True, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None):
        if dtype not in (torch.bfloat16, torch.float32, torch.float16):
            raise TypeError(f"slimfit.NormCache: dtype must be bfloat16, float16 or float32, got {dtype}")
        self.per_token = bool(per_token)
        self.dtype = dtype
        self.device = None if device is None else torch.device(device)
        self._table: torch.Tensor | None = None  # (capacity, width), NaN = unknown

    # ------------------------------------------------------------ inspection
    @property
    def capacity(self) -> int:
        return 0 if self._table is None else self._table.shape[0]

    @property
    def width(self) -> int:
        return 0 if self._table is None else self._table.shape[1]

    @property
    def nbytes(self) -> int:
        return 0 if self._table is None else self._table.numel() * self._table.element_size()

    def num_seen(self) -> int:
        """Samples with at least one known norm (reads the table: a host sync on GPU)."""
        if self._table is None:
            return 0
        return int((~torch.isnan(self._table)).any(dim=1).sum())

    def clear(self) -> None:
        self._table = None

    def __repr__(self) -> str:
        return (f"NormCache(per_token={self.per_token}, dtype={self.dtype}, capacity={self.capacity}, "
                f"width={self.width})")

    # ------------------------------------------------------------ read / write
    def lookup(self, ids: torch.Tensor, length: int, device: torch.device | str | None = None) -> torch.Tensor:
        """(B, length) fp32 stale norms for ids (B,), NaN where unknown."""
        if device is not None:
            device = torch.device(device)
        else:
            device = self._table.device if self._table is not None else torch.device("cpu")
        b = ids.numel()
        out = torch.full((b, length), float("nan"), dtype=torch.float32, device=device)
        if self._table is None or b == 0 or length == 0:
            return out
        ids = ids.reshape(-1).to(torch.int64)
        inside = ids < self.capacity
        safe = torch.where(inside, ids, torch.zeros_like(ids)).to(self._table.device)
        rows = self._table.index_select(0, safe).float().to(device)
        rows = torch.where(inside.to(device)[:, None], rows, torch.full((), float("nan"), device=device))
        if self.per_token:
            w = min(length, self.width)
            out[:, :w] = rows[:, :w]
        else:
            out[:] = rows[:, :1]
        return out

    def update(self, ids: torch.Tensor, norms: torch.Tensor) -> None:
        """Store norms (B, length) as the latest ‖gᵢ‖ of samples ids (B,)."""
        ids = ids.reshape(-1).to(torch.int64)
        if norms.dim() != 2 or norms.shape[0] != ids.numel():
            raise ValueError(f"slimfit.NormCache.update: norms must be (len(ids)={ids.numel()}, rows per sample), "
                             f"got {tuple(norms.shape)}")
        if ids.numel() == 0:
            return
        values = norms.detach().float()
        if not self.per_token:
            if values.shape[1]:
                values = values.mean(dim=1, keepdim=True)
            else:
                values = values.new_full((values.shape[0], 1), float("nan"))
        length = values.shape[1]
        device = self.device or (self._table.device if self._table is not None else values.device)
        self._grow(int(ids.max()) + 1, max(length, 1), device)
        table = self._table
        idx = ids.to(table.device)
        if self.per_token:
            row = torch.full((ids.numel(), table.shape[1]), float("nan"), dtype=table.dtype, device=table.device)
            row[:, :length] = values.to(table.device, table.dtype)
            table.index_copy_(0, idx, row)
        else:
            table.index_copy_(0, idx, values.to(table.device, table.dtype))

    def _grow(self, capacity: int, width: int, device: torch.device) -> None:
        width = width if self.per_token else 1
        if self._table is not None and capacity <= self.capacity and width <= self.width:
            return
        new_cap = max(64, self.capacity)
        while new_cap < capacity:
            new_cap *= 2
        new_w = max(width, self.width)
        table = torch.full((new_cap, new_w), float("nan"), dtype=self.dtype, device=device)
        if self._table is not None:
            table[: self.capacity, : self.width] = self._table.to(device)
        self._table = table

    # ------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        return {"per_token": self.per_token, "table": None if self._table is None else self._table.clone()}

    def load_state_dict(self, state: dict) -> None:
        if bool(state["per_token"]) != self.per_token:
            raise ValueError("slimfit.NormCache.load_state_dict: per_token differs from this cache's")
        table = state["table"]
        self._table = None if table is None else table.to(self.device or table.device, self.dtype).clone()
