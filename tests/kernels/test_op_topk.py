"""slimfit::topk_prune and topk_restore on every backend: bit for bit the reference (values compared by
their bits: NaN of either sign, +-0, ties kept at the lowest indices), the same kept set as torch.topk,
int16/int32 indices, the row lengths of real models, rows cut into chunks; argument errors."""
import pytest
import torch
from _backends import COMPARED, FLOATS, LAUNCHES, check, gen, randn, ties, ties_nan_inf

from slimfit.kernels import reference
from slimfit.kernels.validation import topk_index_dtype

BY = [pytest.param(False, id="by_value"), pytest.param(True, id="by_magnitude")]


def prune_restore(backend, x, k, by_magnitude):
    """topk_prune and topk_restore of its result vs the reference, bit for bit; returns the pruned pair."""
    got, _ = check(backend, "topk_prune", x, k, by_magnitude, bitwise=True)
    check(backend, "topk_restore", *got, x.shape[-1], bitwise=True)
    return got


def _inputs(dtype, device):
    g = gen(3)
    return [t.to(device) for t in (
        torch.randn(4, 77, generator=g).to(dtype),
        torch.randint(-3, 4, (5, 64), generator=g).to(dtype),     # many ties
        torch.randint(-1, 2, (2, 3, 33), generator=g).to(dtype),  # 3-d, ties
        torch.randn(1, generator=g).to(dtype),                    # one element
        torch.tensor([0.0, -0.0, 0.0, -0.0, 1.0, -1.0], dtype=dtype),  # +-0 tie
    )] + [
        randn((9, 8), dtype, seed=4, device=device).t(),          # non-contiguous
        randn((6, 40), dtype, seed=5, device=device)[:, 3:35],    # sliced rows
    ]


@pytest.mark.backend_grid(reason=f"{COMPARED}; {LAUNCHES}", reference=False, interpreter={"dtype": (torch.float32,)})
@pytest.mark.parametrize("by_magnitude", BY)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_matches_reference(backend, dtype, by_magnitude):
    inputs = backend.choose(_inputs(dtype, backend.device),
                            [ties(shape, dtype, seed=i, device=backend.device)
                             for i, shape in enumerate([(1, 1), (3, 7), (2, 3, 33), (4, 300)])]
                            + [randn((2, 300), dtype, device=backend.device)])
    for x in inputs:
        row = x.shape[-1]
        ks = backend.choose((1, 2, max(1, row // 10), row // 2 or 1, row - 1 or 1, row), (1, max(1, row // 3), row))
        for k in sorted({min(k, row) for k in ks}):
            prune_restore(backend, x, k, by_magnitude)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_ties_and_non_contiguous(backend, dtype):
    prune_restore(backend, ties((3, 40), dtype, device=backend.device), 9, True)
    x = randn((33, 4), dtype, device=backend.device).t()
    assert not x.is_contiguous()
    prune_restore(backend, x, 4, False)


@pytest.mark.backend_grid(reason=f"{LAUNCHES} (its bits are the reference's: test_matches_reference)",
                          interpreter={"dtype": (torch.float32,), "shape": ((1, 1),)})
@pytest.mark.parametrize("shape,k", [((1, 1), 1), ((3, 77), 1), ((3, 77), 8), ((3, 77), 77), ((2, 4, 128), 13)])
@pytest.mark.parametrize("by_magnitude", BY)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_keeps_what_torch_topk_keeps(backend, shape, k, by_magnitude, dtype):
    x = randn(shape, dtype, scale=1.0, device=backend.device)
    values, indices = backend.topk_prune(x, k, by_magnitude)
    assert values.dtype == dtype and indices.dtype == torch.int16
    x, values, indices = x.cpu(), values.cpu(), indices.cpu().long()
    key = (x.abs() if by_magnitude else x).float()
    kept_keys = torch.gather(key, -1, indices)
    # equal index sets up to ties: same multiset of kept keys, and nothing dropped beats a kept one
    top = torch.topk(key, k, dim=-1).values
    assert torch.equal(torch.sort(kept_keys, dim=-1).values, torch.sort(top, dim=-1).values)
    dropped = key.scatter(-1, indices, float("-inf"))
    assert bool((dropped.amax(-1) <= kept_keys.amin(-1)).all())
    assert bool((indices[..., 1:] > indices[..., :-1]).all())  # ascending
    assert torch.equal(values, torch.gather(x, -1, indices))
    dense = backend.topk_restore(values.to(backend.device), indices.to(backend.device), shape[-1]).cpu()
    assert torch.equal(dense, torch.zeros_like(x).scatter(-1, indices, values))


def test_ties_keep_lowest_indices(backend):
    x = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0, 2.0]], device=backend.device)
    assert backend.topk_prune(x, 3, False)[1].tolist() == [[1, 2, 4]]


def test_signed_zeros_infinities_nan(backend):
    """torch.sort's order: +0.0 and -0.0 tie, NaN of either sign ranks above +Inf, all NaNs tie."""
    inf, nan = float("inf"), float("nan")
    rows = [
        ([0.0, -0.0, -0.0, 0.0, 1.0, -1.0, inf, -inf, 1.0], (1, 3, 5, 9)),
        ([1.0, nan, inf, -nan, -inf, 2.0, nan, 0.5], backend.choose(range(1, 9), (1, 2, 3, 5, 8))),
    ]
    for row, ks in rows:
        x = torch.tensor([row], device=backend.device)
        for by_magnitude in (False, True):
            for k in ks:
                prune_restore(backend, x, k, by_magnitude)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=str)
def test_non_finite_entries_are_kept(backend, bad):
    """check_finite off: NaN/Inf in a row rank first (NaN, +Inf by magnitude), so they reach the
    restored tensor; the wrappers raise only with check_finite=True."""
    x = torch.randn(300, generator=gen(0))
    x[257] = bad
    x = x.view(3, 100)[2:].to(backend.device)
    kept = backend.topk_restore(*backend.topk_prune(x, 3, True), 100)
    assert (kept.isnan() if bad != bad else kept.isinf()).any()


@pytest.mark.backend_grid(reason=f"{COMPARED}; {LAUNCHES}", reference=False)
@pytest.mark.parametrize("by_magnitude", BY)
@pytest.mark.parametrize("shape", [(3, 197), (2, 768), (2, 2048)], ids=str)
def test_model_row_lengths(backend, shape, by_magnitude):
    # 197 (ViT-B/16 tokens: one masked chunk of 256 in Triton), 768 (3 chunks of 256), 2048 (one chunk)
    row = shape[-1]
    x = ties_nan_inf(shape, seed=row, device=backend.device)
    for k in (1, 2, row // 10, row // 2, row - 1, row):
        prune_restore(backend, x, k, by_magnitude)
    prune_restore(backend, randn(shape, seed=row, device=backend.device), row // 10, by_magnitude)


@pytest.mark.backend_grid(reason=COMPARED, reference=False)
def test_long_row_ties_nan_inf(backend):
    # longer than Triton's REGISTER_ROW_MAX: 3 chunks of CHUNK (the last one partial)
    x = ties_nan_inf((2, 9000), seed=13, device=backend.device)
    for k in (1, 900, 9000):
        prune_restore(backend, x, k, False)
        prune_restore(backend, x, k, True)


@pytest.mark.backend_grid(reason=COMPARED, reference=False)
def test_radix_digits_split_late(backend):
    # keys equal in their top 24 bits (the first three radix passes tie) and in all 32
    base = torch.tensor(1.0).view(torch.int32).item()
    words = torch.tensor([base + d for d in (5, 3, 5, 0, 255, 3, 5, 1, 255, 0)], dtype=torch.int32)
    x = words.view(torch.float32).repeat(3, 1)
    x[1] = -x[1]
    x = x.to(backend.device)
    for k in range(1, 11):
        prune_restore(backend, x, k, False)
        prune_restore(backend, x, k, True)


@pytest.mark.backend_grid(reason=f"{COMPARED}; {LAUNCHES}", reference=False, interpreter={"by_magnitude": (True,)})
@pytest.mark.parametrize("by_magnitude", BY)
def test_long_rows_use_int32_indices(backend, by_magnitude, monkeypatch):
    if backend.interpreted:  # fewer, larger chunks: the interpreter pays per operation
        from slimfit.kernels.triton import topk as topk_mod

        monkeypatch.setattr(topk_mod, "CHUNK", 32768)
    x = ties((2, 40000), seed=5, device=backend.device, low=-50, high=50)  # ties at the threshold
    x[0, -10] = 1000.0
    for k in backend.choose((1, 4000, 40000), (1000,)):
        values, indices = prune_restore(backend, x[:1] if backend.interpreted else x, k, by_magnitude)
        assert indices.dtype == torch.int32


@pytest.mark.backend_grid(reason="the interpreter pays per operation: test_long_rows_use_int32_indices",
                          interpreter=False)
@pytest.mark.parametrize("row, index_dtype", [(32768, torch.int16), (32769, torch.int32)], ids=["int16", "int32"])
def test_index_dtype_by_row_length(backend, row, index_dtype):
    """int16 indices up to rows of 32768 (indices 0..32767), int32 beyond."""
    x = randn((1, row), seed=row, device=backend.device)
    values, indices = prune_restore(backend, x, 100, True)
    assert indices.dtype == index_dtype
    assert int(backend.topk_restore(values, indices, row).ne(0).sum()) == 100


def test_empty(backend):
    for shape, k in [((0, 10), 3), ((0, 5), 2), ((3, 0), 1)]:
        for by_magnitude in (False, True):
            prune_restore(backend, torch.empty(shape, device=backend.device), k, by_magnitude)


def test_k_zero(backend):
    """k = 0 is a valid op call (the wrappers ask for k >= 1): empty values and indices per row."""
    prune_restore(backend, randn((3, 4), device=backend.device), 0, False)


@pytest.mark.backend_grid(reason=COMPARED, reference=False)
@pytest.mark.parametrize("row, k, n_rows", [(197, 19, 45), (768, 76, 7), (3, 3, 1500), (5000, 500, 2), (10, 4, 3)])
def test_restore_matches_reference(backend, row, k, n_rows):
    """Several short rows, one long row in chunks, any sorted indices."""
    g = gen(row)
    values = torch.randn(n_rows, k, generator=g).to(backend.device)
    idx = torch.stack([torch.randperm(row, generator=g)[:k].sort().values for _ in range(n_rows)])
    check(backend, "topk_restore", values, idx.to(topk_index_dtype(row)).to(backend.device), row)


@pytest.mark.backend_grid(reason=COMPARED, reference=False)
def test_restore_int64_indices_and_other_dtypes(backend):
    g = gen(8)
    values = torch.randn(3, 4, generator=g, dtype=torch.float64).to(backend.device)
    indices = torch.stack([torch.randperm(10, generator=g)[:4].sort().values for _ in range(3)]).to(backend.device)
    check(backend, "topk_restore", values, indices, 10)
    check(backend, "topk_restore", values.half(), indices.short(), 10)
    check(backend, "topk_restore", values.bfloat16(), indices.int(), 10)


def test_restore_row_length_zero(backend):
    """k >= 1 kept entries cannot sit in rows of length 0: an error naming the problem; no entries in
    rows of length 0 is a valid empty result."""
    v = torch.randn(3, 2, device=backend.device)
    i = torch.zeros(3, 2, dtype=torch.int16, device=backend.device)
    with pytest.raises(backend.errors, match="length 0|row_length is 0"):
        backend.topk_restore(v, i, 0)
    if backend.name == "reference":  # without the op's checks, the reference's scatter refuses it too
        with pytest.raises(RuntimeError):
            reference.topk_restore(v, i, 0)
    check(backend, "topk_restore", v[:, :0], i[:, :0], 0)


def test_invalid_arguments(backend):
    x = randn((4, 25), device=backend.device)
    for k in (26, -1):
        with pytest.raises(backend.errors, match="k must be"):
            backend.topk_prune(x, k, True)
    with pytest.raises(backend.errors, match="dimension"):
        backend.topk_prune(torch.tensor(1.0, device=backend.device), 1, True)
    with pytest.raises(backend.errors, match="dtype"):
        backend.topk_prune(x.to(torch.int32), 1, True)
    v, i = backend.topk_prune(x, 5, True)
    with pytest.raises(backend.errors, match="same shape"):
        backend.topk_restore(v, i[:, :2], 25)
    with pytest.raises(backend.errors, match="int16, int32 or int64"):
        backend.topk_restore(v, i.to(torch.uint8), 25)
    if backend.device == "cpu":  # on a GPU the index check is a device-side assertion (it fails the stream)
        with pytest.raises(backend.errors, match="outside"):
            backend.topk_restore(v, i, 10)
        with pytest.raises(backend.errors, match="outside"):
            backend.topk_restore(v, -i - 1, 25)


def test_restore_rows_shorter_than_k(backend):
    """A row_length smaller than the k entries of each row (a wrong row length): an error naming it, not
    rows where repeated in-range indices silently overwrite each other."""
    v = torch.randn(2, 5, device=backend.device)
    i = torch.tensor([[0, 1, 1, 2, 2], [0, 0, 1, 1, 2]], dtype=torch.int16, device=backend.device)
    with pytest.raises(backend.errors, match="row_length=3 cannot hold the 5 kept entries"):
        backend.topk_restore(v, i, 3)


@pytest.mark.backend_grid(reason="on a GPU the index checks are a device-side assertion (it fails the stream, "
                          "and every later test of the process with it)", cuda=False, triton=False)
def test_restore_indices_strictly_ascending(backend):
    """A repeated index in a row would leave which value lands there to the backend (and the gradient,
    a gather, would reach both): an error, as is a row out of order (topk_prune lists them ascending)."""
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=backend.device)
    for rows in ([[0, 2], [1, 1]], [[2, 1], [0, 1]]):
        with pytest.raises(backend.errors, match="strictly ascending"):
            backend.topk_restore(v, torch.tensor(rows, dtype=torch.int16, device=backend.device), 3)


def test_restore_complex_values_refused(backend):
    """Complex values: one error on every backend (Triton has no complex pointers; it raised a KeyError)."""
    v = torch.ones(1, 2, dtype=torch.complex64, device=backend.device)
    with pytest.raises(backend.errors, match="unsupported values dtype"):
        backend.topk_restore(v, torch.tensor([[0, 1]], device=backend.device), 3)
