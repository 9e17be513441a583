"""A tensor-parallel group on this machine for tests and benchmarks: ``size`` processes (spawned),
joined in a gloo group over loopback, each running ``target(rank, size, *args)``."""
from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from common.cluster.ports import free_port


def run_group(target, size: int, *args) -> None:
    """Run ``target`` (a module-level function) on every rank; returns when all have ended."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_entry, args=(target, size, free_port(), args), nprocs=size, join=True, start_method="spawn")


def _entry(rank: int, target, size: int, port: int, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        target(rank, size, *args)
    finally:
        dist.destroy_process_group()
