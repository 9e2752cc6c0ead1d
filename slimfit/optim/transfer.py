"""Moving one state tensor to host memory and back, asynchronously on CUDA.

CudaTransfer (a CUDA device): host copies are pinned, both directions run on one side stream so they
overlap the training step and stay ordered among themselves (a copy back always follows the copy out):

  to_host(t)        the side stream waits for the compute stream (the optimizer step that last wrote t
                    is finished), copies t into a pinned buffer, and ``t.record_stream(side)`` keeps the
                    allocator from reusing t's memory before the copy has read it; the caller drops t.
                    The host buffer is complete only once the side stream gets there: ``synchronize()``
                    before reading it on the host (a state_dict does this).
  to_device(h, dev) the device tensor is allocated on the compute stream, the side stream waits for it
                    (the block may have been freed by kernels still queued), copies, and records an event:
                    the ticket. The pinned buffer can be dropped at once (the pinned allocator holds it
                    until the copy is done).
  wait(ticket)      the compute stream waits for the event: no host synchronisation. Called right before
                    the optimizer step that reads the state.
  zeros_host(shape, dtype)   a zero host buffer (pinned): a fresh state made on the host, never on the device.
  piece_to_device(h, dev) / piece_to_host_(h, t)
                    one piece of a host buffer (a view of it) copied to the device and back, on the compute
                    stream: the chunked step streams host-held moments through these a piece at a time
                    (host_step.py). The compute stream first waits for the side stream (a whole copy out
                    still writing the buffer); a copy back is ordered before any later read of the buffer on
                    either stream (to_device waits for the compute stream), and ``synchronize()`` waits for
                    both streams before the host reads it.

CpuTransfer (the CPU, or a device without pinned memory): "host" is a separate storage made by a
synchronous copy; it saves nothing on a CPU-only machine and exists so the logic is testable there.
"""
from __future__ import annotations

import torch

__all__ = ["CpuTransfer", "CudaTransfer", "transfer_for"]


class CpuTransfer:
    """Synchronous copies into separate storages; tickets are None."""

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True)

    def to_device(self, host: torch.Tensor, device: torch.device):
        return host.to(device, copy=True), None

    def wait(self, ticket) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def zeros_host(self, shape, dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device="cpu")

    def piece_to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host.to(device, copy=True)

    def piece_to_host_(self, host: torch.Tensor, t: torch.Tensor) -> None:
        host.copy_(t)


class CudaTransfer:
    """Pinned host buffers and one side stream per device (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)
        return host

    def to_device(self, host: torch.Tensor, device: torch.device):
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            out.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        out.record_stream(self.stream)
        return out, event

    def wait(self, ticket) -> None:
        if ticket is not None:
            torch.cuda.current_stream(self.device).wait_event(ticket)

    def synchronize(self) -> None:
        self.stream.synchronize()
        torch.cuda.current_stream(self.device).synchronize()   # pieces copied back on the compute stream

    def zeros_host(self, shape, dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=True)

    def piece_to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return host.to(device, non_blocking=True)

    def piece_to_host_(self, host: torch.Tensor, t: torch.Tensor) -> None:
        host.copy_(t, non_blocking=True)   # the compute stream: t's memory is reused only after the copy


def transfer_for(device: torch.device):
    """CudaTransfer for a CUDA device, CpuTransfer otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaTransfer(device)
    return CpuTransfer()
