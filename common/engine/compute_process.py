"""What a process that computes with the engine sets first thing, before torch loads and before it
starts any other thread: how its OpenMP threads wait between parallel regions
(``common.engine.openmp_wait``: libgomp reads it once, when torch loads it) and that freed
activation memory stays for the next step (``common.engine.heap_reuse``: an arena, once a thread
has one, stays its own) and that large tensors sit on 2 MB pages (``common.engine.huge_pages``:
torch's allocator reads it at its first allocation).  Every entry point that computes -- the
workers, the prewarm server, the benchmarks -- calls ``configure()`` before its first
``import torch``.  Importing this module imports nothing heavy."""
from __future__ import annotations

import os

from common.engine import heap_reuse, huge_pages, openmp_wait

_SET_VARIABLES = (*openmp_wait.VARIABLES, huge_pages.VARIABLE)  # environment variables ``configure`` may set
_caller_environment: dict[str, str | None] | None = None


def configure() -> None:
    global _caller_environment
    if _caller_environment is None:
        _caller_environment = {name: os.environ.get(name) for name in _SET_VARIABLES}
    openmp_wait.configure()
    heap_reuse.configure()
    huge_pages.configure()


def caller_environment() -> dict[str, str | None]:
    """The variables ``configure`` may set, as the process had them before its first call (``None``:
    unset): what a child that is not the engine -- a peer system a benchmark compares with -- should
    run under, rather than the engine's choices."""
    if _caller_environment is None:
        return {name: os.environ.get(name) for name in _SET_VARIABLES}
    return dict(_caller_environment)
