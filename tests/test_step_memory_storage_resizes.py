"""slimfit.step_memory follows storages resized in place (FSDP2 frees a layer's gathered weights with
``UntypedStorage.resize_(0)`` after its forward and allocates them again before its backward): calls that no
dispatch mode sees."""
import torch

from slimfit.memory import measure_step

N = 1 << 20   # 4 MiB of fp32


class _Resizing(torch.nn.Module):
    """A forward that gathers a buffer (grown from nothing), uses it, frees it in place, and then makes a second
    one of the same size: two never live together."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        gathered = torch.empty(0)
        gathered.untyped_storage().resize_(N * 4)          # FSDP2's alloc_storage: grown outside any op
        gathered = gathered.set_(gathered.untyped_storage(), 0, (N,))
        y = gathered[:8].fill_(1.0).sum() * (self.w * x).sum()   # nothing of it saved for backward
        gathered.untyped_storage().resize_(0)              # free_storage: the bytes go, the tensor stays
        second = torch.ones(N)
        return y + second[0]


def test_a_storage_freed_in_place_no_longer_counts_and_one_grown_in_place_does():
    model = _Resizing()
    mem = measure_step(model, (torch.ones(8),), loss_fn=lambda out: out)
    assert N * 4 <= mem.transient < 1.5 * N * 4            # one buffer at the peak, not two
    assert mem.total < mem.resident + 1.5 * N * 4
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_   # the watch is gone after the step
