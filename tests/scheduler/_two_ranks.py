"""Spawned CPU processes over gloo, two or more (the DDP and FSDP2 tests): process-group setup in each
worker, and the launcher that kills hung workers (a collective mismatch would hang)."""
import os
import socket
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_worker(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def run_two_ranks(worker, outdir, steps: int, what: str, timeout_s: float = 240) -> tuple[dict, dict]:
    """Run `worker(rank, 2, port, outdir, steps)` in 2 processes; returns the dicts each saved as rank<r>.pt."""
    return run_ranks(worker, outdir, steps, what, 2, timeout_s)


def run_ranks(worker, outdir, steps: int, what: str, world: int, timeout_s: float = 240) -> tuple:
    """Run `worker(rank, world, port, outdir, steps)` in `world` processes; the dicts each saved as rank<r>.pt."""
    ctx = mp.start_processes(worker, args=(world, free_port(), str(outdir), steps), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.time() + timeout_s
    try:
        while not ctx.join(timeout=5):
            if time.time() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                pytest.fail(f"{what} workers did not finish in time (a collective mismatch would hang)")
    except mp.ProcessExitedException as exc:
        # A worker killed by a signal after it saved its complete results died in the process group's
        # teardown (gloo, rarely: "terminate called without an active exception"), not in the code under
        # test; the results are still checked in full. Anything earlier leaves no file and fails here.
        results = [os.path.join(outdir, f"rank{r}.pt") for r in range(world)]
        if exc.signal_name is None or not all(os.path.isfile(f) for f in results):
            raise
        warnings.warn(f"{what}: a worker died at teardown after saving its results ({exc})", stacklevel=2)
    return tuple(torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world))
