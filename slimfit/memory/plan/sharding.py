"""A planned step sharded as FSDP2 shards it (``StepSpec.world_size`` > 1): one rank's step predicted.

The step is built on fake tensors as any prediction (fakerun.py), then every transformer layer and the root
are wrapped by ``fully_shard`` over a mesh of ``world_size`` ranks of a fake process group (torch's testing
backend "fake": its collectives move nothing, and a prediction needs only their shapes). The rank predicted
is rank 0, the one whose pieces are largest (FSDP2 cuts dim 0 as ``torch.chunk``: the last ranks get the
smaller pieces). The batch is per rank. A real sharded step needs its ranks: measure it with
``python -m bench.sharded``.

The fake group's collectives move nothing and allocate nothing, so a planned CPU step gets gloo's one buffer
of its own back: gloo's reduce-scatter clones its whole input inside the op (FSDP2 passes it every gradient of a
layer, unsharded) and splits the clone into the output, so for that op a rank holds the input twice
(``GlooReduceScatter``; NCCL reduces in place: a CUDA plan has no such copy). Otherwise a lower bound where a
real group's pending work keeps buffers longer. ``slimfit plan`` refuses ``--fit`` with a world size;
bench/results/sharded_cpu.md shows measured against predicted.
"""
from __future__ import annotations

import contextlib

__all__ = ["process_group", "shard", "transformer_layers", "gloo_reduce_scatter"]


@contextlib.contextmanager
def process_group(world_size: int):
    """A fake process group of ``world_size`` ranks, this process rank 0, and its device mesh (None for one
    rank: nothing sharded). Refused where torch.distributed is initialised already (a prediction must not
    replace the caller's process group)."""
    if world_size == 1:
        yield None
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(f"slimfit plan: world_size={world_size} predicts a rank of a sharded step in a process "
                           "group of its own; this process has torch.distributed initialised already. Predict "
                           "from a process without one (the `slimfit plan` command, or before "
                           "init_process_group)")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))   # made outside any fake mode: the mesh holds real ranks
    finally:
        dist.destroy_process_group()


def transformer_layers(model) -> list:
    """The transformer blocks: the first nn.ModuleList of 2+ modules (each its own FSDP2 unit)."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1:
            return list(module)
    raise ValueError("slimfit plan: world_size > 1 wraps each transformer layer with fully_shard, and this model "
                     "has no nn.ModuleList of layers")


def gloo_reduce_scatter():
    """FSDP2's reduce-scatter as gloo runs it, for a planned CPU step: the input cloned for the collective's
    length (the copy gloo makes inside the op), then the fake group's reduce-scatter."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class GlooReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            buffer = input_tensor.clone()   # gloo's own copy of the input, freed when the op returns
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)
            del buffer
            return work

    return GlooReduceScatter()


def shard(model, mesh, device: str = "cuda") -> None:
    """Every transformer layer, then the root, wrapped by FSDP2's ``fully_shard`` over ``mesh``; a planned
    ``device="cpu"`` step reduce-scatters as gloo does (gloo_reduce_scatter). A real process group needs none
    of it: its own backend runs."""
    from torch.distributed.fsdp import fully_shard

    units = [fully_shard(layer, mesh=mesh) for layer in transformer_layers(model)] + [fully_shard(model, mesh=mesh)]
    if device == "cpu" and mesh is not None and _is_fake(mesh):
        comm = gloo_reduce_scatter()   # stateless: one for every unit
        for unit in units:
            unit.set_custom_reduce_scatter(comm)


def _is_fake(mesh) -> bool:
    import torch.distributed as dist

    return dist.get_backend(mesh.get_group()) == "fake"
