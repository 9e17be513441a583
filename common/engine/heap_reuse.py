"""Freed memory stays in the process for the next step: glibc's malloc told not to hand large
blocks back to the kernel.

By default glibc serves each allocation above a threshold (128 KiB, rising to at most 32 MiB)
with a mapping of its own and unmaps it when freed, trims the heap's free top beyond 128 KiB, and
gives threads arenas of their own whose heaps shrink the same way.  An engine step allocates and
frees the same large activations every step (in a 2048-token prefill chunk of Gemma 3 270M the
gated MLP's 2048 x 4096 fp32 output alone is 33.5 MB), so on every step the kernel maps and zeroes
them afresh: 150k-290k page faults (~1 GB of fresh pages) a 2048-token step on a 2-vCPU AVX2 EPYC
VM, where the steps took 4.5-6.0 s against 4.0-4.5 s without them, and the quick offline
workload of ``benchmarks/vs_vllm_cpu.py`` ~10% longer.

``configure()`` sets, through ``mallopt``: one arena for every thread (a worker's engine runs in
a thread of its own, and another arena's heaps are at most 64 MiB: a step's larger blocks would
be mapped afresh again), blocks of up to ``MMAP_THRESHOLD`` served from the heap, and up to
``TRIM_THRESHOLD`` of free heap kept.  It must run before the process starts other threads (a
thread keeps the arena it was given) -- so first thing, where the OpenMP settings are made
(``common.engine.compute_process``).  A setting the environment makes (``MALLOC_ARENA_MAX``,
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or its tunable in ``GLIBC_TUNABLES``)
wins.  The cost: the process keeps its largest step's working set after the step, which the next
step reuses.  Without glibc (musl, macOS) there is nothing to set.
"""
from __future__ import annotations

import ctypes
import os

MMAP_THRESHOLD = 1 << 30  # bytes: blocks up to this size come from the heap
TRIM_THRESHOLD = 1 << 30  # bytes of free heap kept for the next step

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's malloc.h
# (mallopt parameter, its environment variable, its GLIBC_TUNABLES name, value)
SETTINGS = (
    (_M_ARENA_MAX, "MALLOC_ARENA_MAX", "glibc.malloc.arena_max", 1),
    (_M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold", MMAP_THRESHOLD),
    (_M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold", TRIM_THRESHOLD),
)


def configure() -> list[str]:
    """Apply ``SETTINGS`` where the environment does not set them; returns the variables applied
    (empty without glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return []
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    applied = []
    for param, variable, tunable, value in SETTINGS:
        if variable in os.environ or tunable in tunables:
            continue
        if mallopt(param, value) == 1:
            applied.append(variable)
    return applied
