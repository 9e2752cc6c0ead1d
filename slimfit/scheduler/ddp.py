"""torch.distributed support: every rank makes the same freezing decision.

Approach: every rank computes the scores of its trained layers (cheap, and the weights are
identical under DDP), then rank 0's score vector is broadcast to the group — one
collective per step, on the device the scores were computed on when the backend can take
it (NCCL: CUDA; gloo: CPU). The selection that follows is a deterministic function of the
scheduler state, so every rank then freezes exactly the same layers. At construction one
object all-gather checks that every rank has the same candidate layers and adopts rank 0's
initial random scores.

DistributedDataParallel needs:

* ``find_unused_parameters=True``: frozen parameters produce no gradient, and the set
  changes every step. DDP then marks them unused; since every rank freezes the same ones
  they are *globally* unused, and DDP leaves their ``.grad`` untouched (None).
* ``static_graph=False`` (the default): a static graph assumes the same set of used
  parameters every iteration, which ILS changes by design.
* the DDP wrapper built BEFORE the scheduler (while every candidate still requires grad):
  DDP only registers the parameters that require grad when it is constructed, and would
  never synchronise a layer that was frozen at that moment and unfrozen later.
* ``gradient_as_bucket_view`` may be on or off.

FSDP2 (``fully_shard``) is supported: each parameter is a DTensor shard, ``requires_grad``
flips per parameter, and ``sharded.py`` computes the scores from per-shard sums added by one
all-reduce, so every rank gets the same scores without a broadcast. FSDP1
(``FullyShardedDataParallel``) is not: it flattens a unit's parameters into one
``FlatParameter`` whose ``requires_grad`` is all-or-nothing, so single layers cannot be frozen
step by step; the scheduler raises NotImplementedError instead of training wrongly.
"""
from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch
from torch import nn

__all__ = ["check_parallel_wrappers", "check_not_deepspeed", "resolve_group", "DistSync"]


def _is_fsdp1(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except Exception:  # torch built without distributed
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _has_flat_params(params: Sequence[torch.Tensor]) -> bool:
    return any(type(p).__name__ == "FlatParameter" for p in params)


_DEEPSPEED = ("slimfit's ILS scheduler does not support DeepSpeed ZeRO: ZeRO-3 keeps each parameter's values "
              "outside the tensor (p.ds_tensor, the tensor itself empty between uses), so scores, snapshots and "
              "held optimizer state would read nothing; ZeRO-1/2 flatten the trained parameters into groups fixed "
              "when the engine is built, and its optimizer steps them without slimfit's chunked step or held "
              "moments. Shard with FSDP2 (torch.distributed.fsdp.fully_shard; accelerate's FSDP plugin with "
              "fsdp_version=2), under which the scheduler, the chunked step and the 8-bit moments work per shard "
              "(docs/optim.md)")


def _is_deepspeed(obj) -> bool:
    """A DeepSpeed engine or optimizer (by its module), or a ZeRO-3 partitioned parameter (its ds_id)."""
    return type(obj).__module__.split(".")[0] == "deepspeed" or hasattr(obj, "ds_id")


def check_not_deepspeed(*objects) -> None:
    """NotImplementedError (_DEEPSPEED) when any of ``objects`` (a model, an optimizer, parameters) is DeepSpeed's."""
    for obj in objects:
        if obj is not None and _is_deepspeed(obj):
            raise NotImplementedError(_DEEPSPEED)


def check_parallel_wrappers(model: Optional[nn.Module], params: Sequence[torch.Tensor]) -> None:
    """Raise a clear error for settings under which ILS cannot work."""
    check_not_deepspeed(model, *params)
    if (model is not None and _is_fsdp1(model)) or _has_flat_params(params):
        raise NotImplementedError(
            "slimfit's ILS scheduler does not support FSDP1 (FullyShardedDataParallel / FlatParameter): it "
            "flattens a unit's parameters into one FlatParameter with a single requires_grad, so layers cannot "
            "be frozen one by one. Use FSDP2 (torch.distributed.fsdp.fully_shard) or "
            "DistributedDataParallel(find_unused_parameters=True); see docs/scheduler.md.")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        if getattr(model, "static_graph", False):
            raise ValueError(
                "DistributedDataParallel(static_graph=True) assumes the same parameters get gradients every "
                "iteration, but ILS changes the frozen set every step. Build DDP with static_graph=False and "
                "find_unused_parameters=True.")
        if not getattr(model, "find_unused_parameters", True):
            raise ValueError(
                "DistributedDataParallel needs find_unused_parameters=True under ILS: frozen layers produce no "
                "gradient and DDP would wait for them forever. Rebuild it with find_unused_parameters=True "
                "(HF Trainer: ddp_find_unused_parameters=True).")


def resolve_group(distributed: Optional[bool], process_group=None):
    """(active, group). ``distributed=None``: auto (initialised and world size > 1)."""
    import torch.distributed as dist

    if distributed is False:
        return False, None
    avail = dist.is_available() and dist.is_initialized()
    if not avail:
        if distributed:
            raise RuntimeError("distributed=True but torch.distributed is not initialised: call "
                               "torch.distributed.init_process_group() before building the scheduler, or leave "
                               "distributed=None (auto)")
        return False, None
    if dist.get_world_size(process_group) <= 1:
        return False, None
    return True, process_group


def names_digest(names: Sequence[str], shapes: Sequence[tuple]) -> str:
    h = hashlib.sha256()
    for n, s in zip(names, shapes):
        h.update(n.encode())
        h.update(repr(tuple(s)).encode())
    return h.hexdigest()


class DistSync:
    """The collectives of the scheduler under torch.distributed."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.backend = str(dist.get_backend(group))
        self.src = dist.get_global_rank(group, 0) if group is not None else 0

    def init_check(self, digest: str, init_scores: torch.Tensor, seed: int) -> tuple:
        """Same layers on every rank (else raise everywhere), and rank 0's initial scores and seed (what
        follows the seed, such as the frozen state's rounding, must agree between ranks too)."""
        world = self.dist.get_world_size(self.group)
        gathered: list = [None] * world
        self.dist.all_gather_object(gathered, (digest, init_scores.tolist(), int(seed)), group=self.group)
        digests = [g[0] for g in gathered]
        if len(set(digests)) != 1:
            bad = [r for r, d in enumerate(digests) if d != digests[0]]
            raise RuntimeError(
                f"ILS under torch.distributed: the candidate layers differ between ranks (ranks {bad} differ "
                "from rank 0); every rank must build the scheduler on the same model")
        return torch.tensor(gathered[0][1], dtype=torch.float64), gathered[0][2]

    def _device_ok(self, t: torch.Tensor) -> bool:
        if t.device.type == "cpu":
            return "gloo" in self.backend or ":" in self.backend or "mpi" in self.backend
        # NCCL (and mixed 'cpu:gloo,cuda:nccl') take accelerator tensors; plain gloo: move to CPU
        return self.backend != "gloo"

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor on every rank (same shape everywhere)."""
        if not self._device_ok(t):
            if t.device.type != "cpu":
                t = t.cpu()
            elif torch.cuda.is_available():  # NCCL-only group with CPU scores
                t = t.to(torch.device("cuda", torch.cuda.current_device()))
        t = t.contiguous()
        self.dist.broadcast(t, src=self.src, group=self.group)
        return t
