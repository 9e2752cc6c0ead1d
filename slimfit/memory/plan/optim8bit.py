"""8-bit AdamW (torchao.optim.AdamW8bit), when torchao is installed: the real optimizer for a run, and a
stand-in for predictions; and a stand-in of bitsandbytes' AdamW8bit on a GPU (FakeBnbAdamW8bit, below).

torchao keeps each moment of a parameter of at least 4096 elements (and a multiple of the 256-element block)
as an OptimState8bit: codes (1 byte per element), one fp32 scale per block and its own 256-entry fp32
lookup table; smaller parameters keep fp32 moments; every parameter has a 0-d fp32 step. Its step is
compiled per parameter (torch.compile), which slimfit.memory.measure_step's tracker cannot see into, and its state
is a tensor subclass whose storages the tracker cannot reach: a measured step would miss both. So the
prediction does not run torchao on fake tensors; `FakeAdamW8bit` holds fake tensors of exactly that
state (tests/plan check the bytes against torchao's own state) and its step allocates, one parameter at
a time, two fp32 temporaries of the parameter's size: the resident-memory rise of torchao's compiled step
on a 64 MiB parameter measured 129 MiB (torch's own single-tensor AdamW: 128 MiB, its two temporaries).
"""
from __future__ import annotations

import torch

__all__ = ["available", "optimizer_class", "state_tensors", "FakeAdamW8bit", "BLOCK", "MIN_QUANTIZED",
           "bnb_optimizer_class", "bnb_state_tensors", "FakeBnbAdamW8bit", "BNB_BLOCK", "BNB_MIN_8BIT"]

BLOCK = 256
MIN_QUANTIZED = 4096
QMAP_ENTRIES = 256


def available() -> bool:
    """Whether torchao's AdamW8bit imports."""
    try:
        from torchao.optim import AdamW8bit  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or a broken install: not available either way
        return False
    return True


def optimizer_class() -> type:
    """torchao's AdamW8bit class (the planned step builds it over the parameters, lr 0, or one per parameter
    under step_in_backward)."""
    from torchao.optim import AdamW8bit

    return AdamW8bit


def state_tensors(p: torch.Tensor) -> dict:
    """Tensors of the shapes torchao keeps for `p` (empty: only sizes matter), under any fake mode active."""
    state = {"step": torch.tensor(0.0)}
    for moment in ("exp_avg", "exp_avg_sq"):
        if p.numel() >= MIN_QUANTIZED and p.numel() % BLOCK == 0:
            state[moment] = [torch.empty(p.shape, dtype=torch.uint8, device=p.device),
                             torch.empty(p.numel() // BLOCK, dtype=torch.float32, device=p.device),
                             torch.empty(QMAP_ENTRIES, dtype=torch.float32, device=p.device)]
        else:
            state[moment] = torch.empty_like(p, dtype=torch.float32)
    return state


class FakeAdamW8bit(torch.optim.Optimizer):
    """A stand-in of torchao's AdamW8bit for fake runs: its state as plain tensors of the same sizes (made
    at once, as in any step after the first), its step two fp32 temporaries per parameter, in turn."""

    def __init__(self, params, lr: float = 0.0):
        super().__init__(params, {"lr": lr})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = state_tensors(p)

    @torch.no_grad()
    def step(self, closure=None):
        """Two fp32 temporaries of each parameter with a gradient, one parameter at a time (module docstring)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                first = torch.empty_like(p, dtype=torch.float32)
                second = torch.empty_like(p, dtype=torch.float32)
                del first, second
        return None


BNB_BLOCK = 256
BNB_MIN_8BIT = 4096   # bitsandbytes' min_8bit_size: smaller parameters keep fp32 state


def bnb_optimizer_class() -> type:
    """bitsandbytes' AdamW8bit class (a planned step run for real on a GPU builds it as optimizer_class's)."""
    try:
        from bitsandbytes.optim import AdamW8bit
    except ImportError as e:
        raise ValueError("optimizer adamw8bit-bnb needs bitsandbytes (pip install bitsandbytes)") from e
    return AdamW8bit


def bnb_state_tensors(p: torch.Tensor, qmaps: tuple) -> dict:
    """Tensors of the shapes bitsandbytes' AdamW8bit keeps for ``p`` (its init_state): codes of each moment
    (1 byte per element) and one fp32 absmax per 256-element block, the two 256-entry maps shared by every
    parameter of the optimizer (``qmaps``); fp32 moments below 4096 elements; the step a Python int."""
    if p.numel() < BNB_MIN_8BIT:
        return {"step": 0, "state1": torch.empty_like(p, dtype=torch.float32),
                "state2": torch.empty_like(p, dtype=torch.float32)}
    blocks = -(-p.numel() // BNB_BLOCK)
    state = {"step": 0, "qmap1": qmaps[0], "qmap2": qmaps[1]}
    for i in (1, 2):
        state[f"state{i}"] = torch.empty(p.shape, dtype=torch.uint8, device=p.device)
        state[f"absmax{i}"] = torch.empty(blocks, dtype=torch.float32, device=p.device)
    return state


class FakeBnbAdamW8bit(torch.optim.Optimizer):
    """A stand-in of bitsandbytes' AdamW8bit (not paged) on a GPU, for fake runs: its state as plain tensors of
    the same sizes, made at once. Its CUDA step is one fused kernel per parameter
    (``optimizer_update_8bit_blockwise``: codes decoded, the moments and the weight updated and the codes
    re-encoded in registers), which allocates nothing, so this step allocates nothing either. Its CPU step
    is not this: it decodes each moment of a parameter in full and works in fp32 copies of the parameter
    and its gradient, which is why a plan refuses it on the CPU (step.check_spec)."""

    def __init__(self, params, lr: float = 0.0):
        super().__init__(params, {"lr": lr})
        first = next((p for g in self.param_groups for p in g["params"]), None)
        device = first.device if first is not None else None
        qmaps = tuple(torch.empty(QMAP_ENTRIES, dtype=torch.float32, device=device) for _ in range(2))
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = bnb_state_tensors(p, qmaps)

    @torch.no_grad()
    def step(self, closure=None):
        """Nothing allocated: the fused kernel updates weights and state in place (class docstring)."""
        return None
