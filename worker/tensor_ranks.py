"""A worker with ``--tensor-parallel-size N``: this process is rank 0 (it schedules, samples and
serves HTTP and KV), and N - 1 follower processes hold the other shares of the model
(``common/engine/parallel``), each computing every step rank 0 sends.  They start and end as one
unit:

* ``start`` spawns the followers and joins them in a gloo group (NCCL on CUDA) on loopback, before
  rank 0 builds its engine; a follower that cannot start fails the worker's start.  They meet
  through a file in a private directory (a ``tcp://`` rendezvous is torch's TCPStore, listening on
  every interface for anyone to read or overwrite the ranks' addresses), and the group's own sockets
  are on loopback (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, unless the environment says);
* a follower is bound to the worker's life (``PR_SET_PDEATHSIG``: it dies with it, however the
  worker dies), and ``watch`` reports a follower that exits while the worker runs: the worker then
  fails as a whole (it leaves the pool, its requests end with an error, it exits non-zero); a
  follower that hangs stalls rank 0's next collective, which the engine watchdog turns into the
  same failure;
* ``stop`` (the worker's shutdown, after the engine thread has told the followers to stop) waits
  for them, then kills what is left.

Rank 0 maps the followers' KV caches (``parallel/shared_kv.py``): its KV endpoint ships and lands
every rank's heads in that rank's memory, so a TP worker prefills and decodes for peers of any TP
size (``common/engine/kv/kv_shards.py``).
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
from datetime import timedelta
from typing import Callable

from common.engine.config import EngineConfig

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 300.0  # followers load their share of the model before the group forms
STOP_WAIT_S = 10.0
PR_SET_PDEATHSIG = 1
LOOPBACK_SOCKETS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # the ranks share a host: loopback


def _backend(config: EngineConfig) -> str:
    import torch

    return "nccl" if config.device != "cpu" and torch.cuda.is_available() else "gloo"


def _follow(rank: int, size: int, rendezvous: str, config: EngineConfig) -> None:
    """A follower rank's whole life (its own process)."""
    import ctypes
    import signal

    import torch
    import torch.distributed as dist

    from common.engine.engine import Engine

    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if config.device != "cpu" and torch.cuda.is_available():
        torch.cuda.set_device(rank)
    dist.init_process_group(_backend(config), init_method=rendezvous, rank=rank, world_size=size,
                            timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    engine = Engine(config, load_tokenizer=False)
    engine.follow()
    dist.destroy_process_group()


class TensorRanks:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.size = config.tensor_parallel_size
        self.followers: list[multiprocessing.Process] = []
        self._stopping = False
        self._directory: str | None = None  # the rendezvous file's (mode 0700)

    def start(self) -> None:
        """Spawn the followers and form the group (blocking: run it off the event loop)."""
        import torch.distributed as dist

        for variable in LOOPBACK_SOCKETS:  # read by the followers too (they inherit the environment)
            os.environ.setdefault(variable, "lo")
        self._directory = tempfile.mkdtemp(prefix="pdserve-tp-")
        rendezvous = f"file://{os.path.join(self._directory, 'rendezvous')}"
        context = multiprocessing.get_context("spawn")
        for rank in range(1, self.size):
            process = context.Process(target=_follow, args=(rank, self.size, rendezvous, self.config),
                                      name=f"tp-rank-{rank}", daemon=True)
            process.start()
            self.followers.append(process)
        log.info("tensor parallelism: %d ranks (followers %s)", self.size, [p.pid for p in self.followers])
        dist.init_process_group(_backend(self.config), init_method=rendezvous, rank=0,
                                world_size=self.size, timeout=timedelta(seconds=JOIN_TIMEOUT_S))

    def watch(self, on_death: Callable[[str], None]) -> threading.Thread:
        """A thread that calls ``on_death(why)`` once if a follower exits before ``stop``."""
        def run() -> None:
            sentinels = {p.sentinel: p for p in self.followers}
            ready = multiprocessing.connection.wait(list(sentinels))
            if not self._stopping:
                process = sentinels[ready[0]]
                process.join(1)
                on_death(f"tensor-parallel rank {process.name} exited ({process.exitcode})")

        thread = threading.Thread(target=run, name="tp-watch", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """After the followers were told to stop (or the engine failed): wait, then kill."""
        self._stopping = True
        for process in self.followers:
            process.join(STOP_WAIT_S)
        for process in self.followers:
            if process.is_alive():
                process.kill()
                process.join(STOP_WAIT_S)
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
