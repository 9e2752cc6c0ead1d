"""slimfit.step_memory and a process group's own buffers: gloo's reduce-scatter clones its whole input inside the
c10d op (no op a dispatch mode sees) and splits that clone into the output right after it. The clone is born at
the collective, not resident since the step's entry (FSDP2 reduce-scatters every layer's gradients: counted from
the entry, those clones added a full copy of the weights to a sharded step's forward)."""
import os
import socket

import pytest
import torch
import torch.distributed as dist

from slimfit.memory import measure_step

N = 1 << 20   # 4 MiB of fp32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ForwardThenReduceScatter(torch.nn.Module):
    """A forward whose largest moment is a 2 x 4 MiB temporary, then a reduce-scatter of a 4 MiB buffer in
    backward (a hook on the output), as FSDP2's post-backward runs it."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        big = torch.ones(2 * N)
        y = (self.w * x).sum() + big[0]
        del big
        y.register_hook(self._reduce_scatter)
        return y

    @staticmethod
    def _reduce_scatter(grad):
        full, out = torch.ones(N), torch.empty(N)
        dist.reduce_scatter_single(out, full)
        return grad


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="gloo is needed")
def test_a_collective_own_buffer_is_born_at_the_collective():
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mem = measure_step(_ForwardThenReduceScatter(), (torch.ones(8),), loss_fn=lambda out: out)
    finally:
        dist.destroy_process_group()
    assert mem.found_resident == 0                       # the clone is not taken for a storage from before the step
    assert mem.peak_phase == "backward"                  # input, output and gloo's clone: 3 x 4 MiB at the collective
    assert 3 * N * 4 <= mem.transient < 3.5 * N * 4
    assert mem.phase_peaks["forward"] < mem.resident + 2.5 * N * 4   # the forward's 8 MiB, no clone counted there
