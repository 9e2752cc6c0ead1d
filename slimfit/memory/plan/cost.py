"""How long a step takes, estimated from the ops of its fake run: a roofline sum, calibrated per device.

    seconds = flops / FLOPS + bytes_moved / BYTES_PER_S + ops * OP_OVERHEAD_S

flops: matrix products, attention and convolutions (torch.utils.flop_counter's formulas, plus the CPU flash
attention kernels it lacks); bytes_moved: every op's tensor inputs read and outputs written; ops: the number
of dispatched ops (each has a fixed cost: dispatch, a kernel launch on a GPU). Why this model: the choices
`slimfit plan --fit` weighs change exactly these three counts. Freezing removes weight-gradient matmuls
(flops); checkpointing reruns the forward (flops, bytes, ops); slimfit's presets add quantize / dequantize
passes and recompute attention probabilities (bytes, ops); LoRA removes the base's weight gradients and adds
small matmuls (flops, ops). Only the order of configurations at one batch matters to --fit; the CPU constants
were fitted to measured step times (docs/plan.md, "the time model"); the CUDA ones are nominal (no GPU here).
"""
from __future__ import annotations

__all__ = ["CostCounter", "step_seconds", "DEVICE_RATES", "HOST_LINK_BYTES_PER_S", "host_traffic_seconds"]

# (matmul FLOP/s fp32, matmul FLOP/s bf16, bytes/s, seconds per op)
DEVICE_RATES = {
    "cpu": (1.05e11, 3.3e11, 4.0e10, 2.0e-6),    # fitted (least squares) to one thread's CPU time of 10 BERT-base
                                                 # steps (4 layers, batch 4, seq 128: plain, rates, presets, LoRA,
                                                 # checkpointing, bf16) on the AMD EPYC of the results; per op:
                                                 # a tiny op's cost there. More threads shrink the matmul term.
    "cuda": (5.0e13, 4.0e14, 2.5e12, 8.0e-6),    # H100-class, nominal (fp32 without TF32; bf16 tensor cores)
}


def _attention_flops(q, k, backward: bool) -> float:
    """2 * B * H * Sq * Sk * D for Q K^T and again for P V; backward ~2.5x the forward (recomputation)."""
    b, h, sq, d = q.shape
    sk = k.shape[-2]
    forward = 4.0 * b * h * sq * sk * d
    return 2.5 * forward if backward else forward


def _flops(func, args, kwargs, out) -> float:
    """Floating-point operations of one op: torch's flop formulas, or the CPU flash attention ones; 0 for the rest."""
    import torch
    from torch.utils.flop_counter import flop_registry

    packet = func._overloadpacket
    if packet in flop_registry:
        try:
            return float(flop_registry[packet](*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not take this overload's arguments: counted as memory traffic
            return 0.0
    if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
        return _attention_flops(args[0], args[1], backward=False)
    if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        return _attention_flops(args[1], args[2], backward=True)
    return 0.0


class CostCounter:
    """Sums flops, bytes moved and ops over the ops it is shown (`add`, a fake.PlanMode callback)."""

    def __init__(self):
        self.flops = 0.0
        self.bytes = 0.0
        self.ops = 0
        self.active = False

    def add(self, func, args, kwargs, out) -> None:
        """Count one op: its flops, the bytes of its tensor inputs and outputs, and the op itself."""
        import torch
        from torch.utils._pytree import tree_flatten

        if not self.active:
            return
        self.ops += 1
        flat, _ = tree_flatten((args, kwargs, out))
        self.bytes += sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
        self.flops += _flops(func, args, kwargs, out)


# host <-> device, bytes/s each way: a PCIe Gen5 x16 link's practical rate (nominal 64 GB/s); the traffic of
# optimizer_state="host" (every trained parameter's moments copied in for its step and back), which the op
# counts above do not see (the copies go to pinned host memory on a side stream)
HOST_LINK_BYTES_PER_S = 25e9


def host_traffic_seconds(trained_params: float, moment_bytes: int) -> float:
    """Seconds a step spends moving the two moments of `trained_params` parameters (each `moment_bytes` an
    element) to the device and back, at HOST_LINK_BYTES_PER_S each way: PCIe is full duplex, so the copies out
    (on a side stream) overlap the copies in, and one direction's bytes set the time."""
    return trained_params * 2 * moment_bytes / HOST_LINK_BYTES_PER_S


def step_seconds(flops: float, bytes_moved: float, ops: int, device: str = "cpu", dtype: str = "fp32") -> float:
    """The estimated step time in seconds on `device` (cpu or cuda) for matmuls in `dtype`."""
    fp32, bf16, bandwidth, per_op = DEVICE_RATES["cuda" if device.startswith("cuda") else "cpu"]
    rate = bf16 if dtype == "bf16" else fp32
    return flops / rate + bytes_moved / bandwidth + ops * per_op
