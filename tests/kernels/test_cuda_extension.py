"""What only the extension's CUDA kernels (csrc/cuda/quantize.cu) have: they serve quantize/dequantize,
a tensor of a million elements in many blocks, another device and a side stream. Their results on
every input: the `cuda` backend of test_op_*.py. Needs a GPU: `pytest -m gpu tests/kernels`.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from _backends import FLOATS, assert_same, make_backend, randn  # noqa: E402

from slimfit import kernels as K  # noqa: E402
from slimfit.kernels import reference as R  # noqa: E402

_info = K.backend_info()
if not {"quantize", "dequantize"} <= set(_info["cuda_extension_ops"]):
    pytest.skip(f"slimfit._C was built without its CUDA kernels (or SLIMFIT_BACKEND=reference): {_info}",
                allow_module_level=True)

ops = torch.ops.slimfit


def test_served_by_the_extension():
    for op in ("quantize", "dequantize"):
        dump = torch._C._dispatch_dump(f"slimfit::{op}")
        line = next(ln for ln in dump.splitlines() if ln.startswith("CUDA:"))
        assert "quantize.cu" in line, line
    assert not {"quantize", "dequantize"} & make_backend("cuda").triton_ops


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_large_tensor_many_blocks(dtype):
    x = randn(((1 << 20) + 13,), dtype, seed=5, device="cuda")
    for bits, group_size in [(2, 32), (4, 128), (8, 256)]:
        for stochastic in (False, True):
            got = ops.quantize(x, bits, group_size, stochastic, 2**40 + 3)
            want = R.quantize(x.cpu(), bits, group_size, stochastic, 2**40 + 3)
            assert_same(got, want, "quantize")
            y = ops.dequantize(*got, bits, group_size, list(x.shape), dtype)
            assert_same(y, R.dequantize(*want, bits, group_size, list(x.shape), dtype), "round trip")


def test_other_device_and_stream():
    x = randn((5, 300), torch.float16, seed=6, device="cuda")
    if torch.cuda.device_count() > 1:
        x1 = x.to("cuda:1")
        codes, scale, offset = ops.quantize(x1, 8, 128, True, 3)
        assert codes.device == scale.device == offset.device == x1.device
        assert_same((codes, scale, offset), R.quantize(x.cpu(), 8, 128, True, 3), "cuda:1")
        y = ops.dequantize(codes, scale, offset, 8, 128, [5, 300], torch.float16)
        assert y.device == x1.device
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # x was written on the default stream
    with torch.cuda.stream(s):
        codes, scale, offset = ops.quantize(x, 4, 64, False, 0)
        y = ops.dequantize(codes, scale, offset, 4, 64, [5, 300], torch.float32)
    s.synchronize()
    rc, rs, ro = R.quantize(x.cpu(), 4, 64, False, 0)
    assert_same(codes, rc, "codes on a side stream")
    assert_same(y, R.dequantize(rc, rs, ro, 4, 64, [5, 300], torch.float32), "dequantize on a side stream")
