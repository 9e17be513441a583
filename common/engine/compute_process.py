"""What a process that computes with the engine sets first thing, before torch loads and before it
starts any other thread: how its OpenMP threads wait between parallel regions
(``common.engine.openmp_wait``: libgomp reads it once, when torch loads it) and that freed
activation memory stays for the next step (``common.engine.heap_reuse``: an arena, once a thread
has one, stays its own) and that large tensors sit on 2 MB pages (``common.engine.huge_pages``:
torch's allocator reads it at its first allocation).  Every entry point that computes -- the
workers, the prewarm server, the benchmarks -- calls ``configure()`` before its first
``import torch``.  Importing this module imports nothing heavy."""
from __future__ import annotations

from common.engine import heap_reuse, huge_pages, openmp_wait


def configure() -> None:
    openmp_wait.configure()
    heap_reuse.configure()
    huge_pages.configure()
