"""Bodies of the two-process accelerate FSDP2 tests (imported by spawned processes): a tiny Llama prepared by
accelerate's FSDP2 plugin, trained under slimfit's defaults, against the same model sharded by hand (``run``);
the HF Trainer with ``fsdp`` configured and SlimFitCallback (``run_trainer``).

accelerate selects FSDP only on accelerator devices: on the CPU its state says MULTI_CPU whatever plugin is
given. So after the Accelerator is built the worker sets the shared state's distributed type to FSDP (and its
plugin), and ``prepare`` then takes accelerate's FSDP2 path, as it does on a GPU: ``fully_shard`` on each
decoder layer and on the root, the optimizer's parameters switched to the sharded DTensors, the optimizer
wrapped in an AcceleratedOptimizer. The Trainer builds its own Accelerator; the worker forces its state the
same way right after the Trainer is built (and the Trainer's ``is_fsdp_enabled``, which it read from that
state)."""
import copy
import os

import torch
import torch.distributed as dist
from _models import tiny_llama

from slimfit.optim.keys import Q8

VOCAB = 128


def run(rank, world, port, outdir, steps):
    _in_process_group(_body, rank, world, port, outdir, steps)


def run_trainer(rank, world, port, outdir, steps):
    _in_process_group(_trainer, rank, world, port, outdir, steps)


def _in_process_group(body, rank, world, port, outdir, steps):
    """body(rank, steps, outdir)'s results saved as rank<r>.pt; accelerate makes the gloo group from the env."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        torch.save(body(rank, steps, outdir), os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _plugin():
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                          auto_wrap_policy="transformer_based_wrap",
                                          transformer_cls_names_to_wrap=["LlamaDecoderLayer"])


def _force_fsdp(state, plugin) -> None:
    """The accelerate state made FSDP's on the CPU (see the module docstring)."""
    from accelerate.utils import DistributedType

    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin


def _accelerated(model, opt):
    from accelerate import Accelerator

    plugin = _plugin()
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    _force_fsdp(accelerator.state, plugin)
    model, opt = accelerator.prepare(model, opt)
    return accelerator, model, opt


def _by_hand(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _ids(rank):
    """Each rank's own batch (2 rows of 16 tokens, every label counted: the ranks' mean is the union's mean)."""
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(rank))


def _train(model, opt, sched, steps, ids, backward):
    log, losses = [], []
    for _ in range(steps):
        log.append(tuple(sched.frozen_names()))
        loss = model(input_ids=ids, labels=ids).loss
        backward(loss)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(float(loss.detach()))
    return log, losses


def _body(rank, steps, outdir):
    from slimfit.optim.sharded_params import blocks_fixed
    from slimfit.scheduler import ILSScheduler

    base = tiny_llama()
    out = {}
    model = copy.deepcopy(base)
    accelerator, model, opt = _accelerated(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, seed=0, warmup_steps=0)
    log, losses = _train(model, opt, sched, steps, _ids(rank), accelerator.backward)
    inner = opt.optimizer
    out["accelerated"] = {
        "log": log, "losses": losses, "optimizer": type(opt).__name__,
        "dtensor": all(type(p).__name__ == "DTensor" for p in model.parameters()),
        "chunked": sched.chunked_step is not None and sched.chunked_step.pieces_stepped > 0,
        "between_steps": sched.state_holder is not None and sched.state_holder.between_steps,
        "held": sum(1 for st in inner.state.values() for k in st if k.endswith(Q8)),
        "in_full": sorted(n for n, p in model.named_parameters() if "exp_avg" in inner.state.get(p, {})),
        # a shard that would cut a block of the 8-bit code keeps its moments in full (sharded_params.py)
        "cut": sorted(n for n, p in model.named_parameters() if not blocks_fixed(p, 128)),
        "weights": {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}}
    sched.close()

    hand = _by_hand(copy.deepcopy(base))
    opt_hand = torch.optim.AdamW(hand.parameters(), lr=1e-3)
    sched_hand = ILSScheduler(hand, freeze_rate=0.5, optimizer=opt_hand, seed=0, warmup_steps=0)
    log, losses = _train(hand, opt_hand, sched_hand, steps, _ids(rank), lambda loss: loss.backward())
    out["by_hand"] = {"log": log, "losses": losses,
                      "weights": {n: p.detach().full_tensor().clone() for n, p in hand.named_parameters()}}
    return out


def _trainer(rank, steps, outdir):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from slimfit.optim.sharded_params import blocks_fixed
    from slimfit.scheduler import SlimFitCallback

    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2 * steps, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=outdir, per_device_train_batch_size=1, max_steps=steps, use_cpu=True,
                             fsdp=True, fsdp_config={"version": 2, "reshard_after_forward": True,
                                                     "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
                             max_grad_norm=1.0, learning_rate=1e-3, report_to=[], logging_steps=1,
                             save_strategy="no", seed=0)
    callback = SlimFitCallback(freeze_rate=0.5, warmup_steps=0, seed=0)
    seen = {}

    class Seen(TrainerCallback):
        """What the scheduler attached, read at the last step (the callback closes it at the end)."""

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            sched, inner = callback.scheduler, optimizer.optimizer
            seen.update(dtensor=all(type(p).__name__ == "DTensor" for p in model.parameters()),
                        chunked=sched.chunked_step is not None and sched.chunked_step.pieces_stepped > 0,
                        between_steps=sched.state_holder is not None and sched.state_holder.between_steps,
                        held=sum(1 for st in inner.state.values() for k in st if k.endswith(Q8)),
                        in_full=sorted(n for n, p in model.named_parameters()
                                       if "exp_avg" in inner.state.get(p, {})),
                        cut=sorted(n for n, p in model.named_parameters() if not blocks_fixed(p, 128)))

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback, Seen()])
    _force_fsdp(trainer.accelerator.state, _plugin())
    trainer.is_fsdp_enabled = True
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    weights = {n: p.detach().full_tensor().clone() for n, p in trainer.model_wrapped.named_parameters()}
    logged = [h["slimfit_frozen_share"] for h in trainer.state.log_history if "slimfit_frozen_share" in h]
    return {**seen, "logged": logged, "weights": weights,
            "moved": sorted(n for n, w in weights.items() if not torch.equal(w, before[n]))}
