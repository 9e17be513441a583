"""A tensor-parallel group on this machine for tests and benchmarks: ``size`` processes, joined in a
gloo group over loopback (NCCL with ``backend="nccl"``, rank r on cuda:r), each running
``target(rank, size, *args)``.

Ranks are forked from multiprocessing's fork server, which imports torch once (``PRELOADED``)
instead of once per rank: a rank then starts in a fraction of a second.  NCCL ranks are spawned
(CUDA does not survive a fork of a process that initialised it, and the server need not have)."""
from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from common.cluster.ports import free_port


PRELOADED = ["torch", "torch.distributed", "common.engine.engine"]


def run_group(target, size: int, *args, backend: str = "gloo") -> None:
    """Run ``target`` (a module-level function) on every rank; returns when all have ended."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if backend == "nccl":
        start_method = "spawn"
    else:
        start_method = "forkserver"
        mp.set_forkserver_preload(PRELOADED)
    mp.start_processes(_entry, args=(target, size, free_port(), backend, args), nprocs=size, join=True,
                       start_method=start_method)


def _entry(rank: int, target, size: int, port: int, backend: str, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // size))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        target(rank, size, *args)
    finally:
        dist.destroy_process_group()
