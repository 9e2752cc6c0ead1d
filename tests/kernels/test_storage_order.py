"""quantize(storage_order=True): a permuted view (attention's Q/K/V) is quantized as it lies in
memory, without a contiguous copy, and dequantizes to the same logical tensor shape."""
import pytest
import torch

from slimfit.kernels import api
from slimfit.kernels.api import dequantize, quantize, storage_permutation


def _qkv_view(seed=0, shape=(2, 5, 3, 8)):
    base = torch.randn(shape, generator=torch.Generator().manual_seed(seed))  # (B, S, H, D) as a projection writes it
    return base, base.transpose(1, 2)                                         # (B, H, S, D) view


def test_permutation_of_views():
    base, x = _qkv_view()
    assert storage_permutation(base) is None                 # contiguous: logical order is memory order
    dims = storage_permutation(x)
    assert dims == (0, 2, 1, 3) and x.permute(dims).is_contiguous()
    assert storage_permutation(base[:, ::2]) is None          # a strided slice is not a permutation
    assert storage_permutation(torch.randn(3, 1).expand(3, 4)) is None


@pytest.mark.parametrize("bits", [4, 8])
def test_same_codes_as_the_base_and_logical_shape_back(bits):
    base, x = _qkv_view()
    q = quantize(x, bits, 32, storage_order=True)
    ref = quantize(base, bits, 32)                            # the memory order, quantized plainly
    assert torch.equal(q.codes, ref.codes) and torch.equal(q.scale, ref.scale)
    assert q.shape == tuple(x.shape) and q.nbytes == ref.nbytes
    out = dequantize(q)
    assert out.shape == x.shape
    assert torch.equal(out, dequantize(ref).transpose(1, 2))
    assert (out - x).abs().max() <= q.scale.max() / 2 + 1e-6   # round to nearest: half a step at most


def test_no_copy_of_the_view(monkeypatch):
    base, x = _qkv_view(1)
    seen = []
    real = api.ops.quantize

    class Spy:
        def quantize(self, t, *args):
            seen.append((t.data_ptr(), t.is_contiguous()))
            return real(t, *args)

        def __getattr__(self, name):
            return getattr(torch.ops.slimfit, name)

    monkeypatch.setattr(api, "ops", Spy())
    quantize(x, 8, 32, storage_order=True)
    assert seen == [(base.data_ptr(), True)]


def test_default_keeps_logical_order():
    base, x = _qkv_view(2)
    q = quantize(x, 8, 32)
    assert q.storage_dims is None
    assert torch.equal(q.codes, quantize(x.contiguous(), 8, 32).codes)
