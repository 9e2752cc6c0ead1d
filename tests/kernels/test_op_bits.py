"""slimfit::pack_bits and unpack_bits on every backend: bit for bit the reference (element i of the
flattened mask is bit i % 8 of byte i // 8, unused high bits zero), any shape or layout; errors."""
import math

import pytest
import torch
from _backends import LAUNCHES, check, gen


@pytest.mark.backend_grid(reason=LAUNCHES, interpreter={"n": (0, 1, 7, 8, 9, 1003, 9000)})
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 64, 1003, 9000, 100_000])
def test_round_trip_and_layout_match_reference(backend, n):
    g = gen(n)
    mask = (torch.rand(n, generator=g) > 0.5).to(backend.device)
    packed, _ = check(backend, "pack_bits", mask)
    assert packed.numel() == math.ceil(n / 8)
    if n % 8:  # unused high bits of the last byte are zero
        assert int(packed[-1]) >> (n % 8) == 0
    unpacked, _ = check(backend, "unpack_bits", packed, n)
    assert torch.equal(unpacked, mask)
    # random bytes, more of them than numel needs
    raw = torch.randint(0, 256, ((n + 7) // 8 + 1,), dtype=torch.uint8, generator=g).to(backend.device)
    check(backend, "unpack_bits", raw, n)


def test_shapes_and_non_contiguous(backend):
    g = gen(4)
    masks = [torch.rand(3, 77, generator=g) > 0.3, (torch.rand(20, 13, generator=g) > 0.5).t(),
             (torch.rand(9, 40, generator=g) > 0.5)[:, 1:38:3], torch.tensor(True), torch.ones(2, 0, dtype=torch.bool)]
    base = (torch.rand(6, 11, generator=gen(1)) > 0.3).to(backend.device)
    for mask in [m.to(backend.device) for m in masks] + [base.t()]:
        packed, _ = check(backend, "pack_bits", mask)
        unpacked, _ = check(backend, "unpack_bits", packed, mask.numel())
        assert torch.equal(unpacked.view(mask.shape), mask.contiguous())
    check(backend, "unpack_bits", backend.pack_bits(base.t()), 60)  # fewer bits than the bytes hold


def test_layout(backend):
    m = torch.tensor([True, False, False, False, False, False, False, False, True], device=backend.device)
    assert backend.pack_bits(m).tolist() == [1, 1]


def test_invalid_arguments(backend):
    with pytest.raises(backend.errors, match="bool"):
        backend.pack_bits(torch.ones(8, dtype=torch.uint8, device=backend.device))
    packed = torch.zeros(2, dtype=torch.uint8, device=backend.device)
    with pytest.raises(backend.errors, match="cannot hold"):
        backend.unpack_bits(packed, 17)
    with pytest.raises(backend.errors, match="uint8"):
        backend.unpack_bits(packed.to(torch.int32), 8)


def test_unpack_any_layout_of_packed(backend):
    """packed is read as its bytes in order, whatever its shape (2-d, 0-d, a strided view), on every
    backend (the reference raised on all three)."""
    raw = [5, 200, 17, 3]
    flat = torch.tensor(raw, dtype=torch.uint8, device=backend.device)
    want = [bool((b >> i) & 1) for b in raw for i in range(8)]
    for packed, n in [(flat.view(2, 2), 29), (torch.stack([flat, flat], 1)[:, 0], 32), (flat[1], 8)]:
        got, _ = check(backend, "unpack_bits", packed, n)
        assert got.tolist() == want[8 if packed.dim() == 0 else 0:][:n]
