"""torch.library.opcheck on every op, through the dispatcher (whatever backend serves CPU)."""
import pytest
import torch

import slimfit  # noqa: F401

CASES = {
    "quantize": lambda: ((torch.randn(3, 77), 4, 32, True, 5), {}),
    "dequantize": lambda: (
        tuple(torch.ops.slimfit.quantize(torch.randn(3, 77), 4, 32, False, 0)) + (4, 32, [3, 77], torch.float16),
        {},
    ),
    "topk_prune": lambda: ((torch.randn(4, 50), 5, True), {}),
    "topk_restore": lambda: (tuple(torch.ops.slimfit.topk_prune(torch.randn(4, 50), 5, False)) + (50,), {}),
    "pack_bits": lambda: ((torch.rand(3, 11) > 0.5,), {}),
    "unpack_bits": lambda: ((torch.randint(0, 255, (5,), dtype=torch.uint8), 37), {}),
    "dropout_mask": lambda: ((torch.randn(6, 7), 0.25, 3), {}),
    "seeded_dropout": lambda: ((torch.randn(6, 7), 0.25, 3), {}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name):
    args, kwargs = CASES[name]()
    torch.library.opcheck(getattr(torch.ops.slimfit, name).default, args, kwargs)


def test_every_schema_is_checked():
    from slimfit.kernels import SCHEMAS

    assert set(SCHEMAS) == set(CASES)
