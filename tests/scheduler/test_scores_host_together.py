"""scores.add_host_together (the in-step scores of a call's pieces on the CPU) adds to every layer's sums
exactly what BlockSums.add of each piece alone, in order, adds: small pieces reduced together, large ones
block by block, zeros in W_old redone zero-aware, every kind, fp32 and bf16 weights."""
import pytest
import torch

from slimfit.scheduler.scores import BLOCK_NUMEL, BlockSums, add_host_together


def _pieces(dtype):
    g = torch.Generator().manual_seed(0)
    out = []
    for layer, n in [(0, 300), (1, 2 * BLOCK_NUMEL + 5), (0, 77), (2, 1), (1, 128), (2, 4096)]:
        old = torch.randn(n, generator=g)
        if layer == 0:
            old[::5] = 0.0                               # zeros in W_old: the zero-aware relative score
        new = old + 1e-3 * torch.randn(n, generator=g)
        out.append((layer, old.to(dtype), new.to(dtype)))
    return out


@pytest.mark.parametrize("kind", ["relative", "robust", "absolute"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_host_together_is_add_of_each_piece_in_order(kind, dtype):
    alone = {i: BlockSums(kind, dtype) for i in range(3)}
    together = {i: BlockSums(kind, dtype) for i in range(3)}
    pieces = _pieces(dtype)
    for layer, old, new in pieces:
        alone[layer].add(old, new)
    add_host_together([(together[layer], old, new) for layer, old, new in pieces])
    for i in range(3):
        assert together[i].sums() == alone[i].sums(), i
