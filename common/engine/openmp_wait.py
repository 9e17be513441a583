"""How the engine's OpenMP threads wait between parallel regions: spin briefly, then sleep.

Set before torch loads its OpenMP runtime (libgomp reads the environment once), so every entry
point that computes (the workers, the prewarm server, the benchmarks) calls ``configure()`` before
its first ``import torch``.  Importing this module imports nothing heavy.

A decode step is a few hundred short parallel regions (a oneDNN product per projection, the paged
attention kernel, elementwise ops) separated by microseconds of Python.  The two choices at the
ends both lose:

- **sleeping at once** (``OMP_WAIT_POLICY=PASSIVE`` alone): every region then wakes the other
  threads through the kernel; on a 2-vCPU VM that wake cost ~90 us a region (the paged attention
  call at batch 1: 134 us passive, 43 us spinning), ~25 ms of a 16-request decode step of Gemma 3
  270M in fp32 (129 -> 104 ms with the spin below);
- **spinning without end** (``OMP_WAIT_POLICY=ACTIVE``): threads that share the cores with the
  worker's HTTP loop, another worker or other work wait on descheduled spinners -- a decode step
  was ~5x slower with 2 spinning threads than with 1 on a busy 2-core machine.

So the threads sleep (``PASSIVE``), after spinning ``GOMP_SPINCOUNT`` times (libgomp estimates
~100k spins a millisecond: ~0.3 ms), long enough to bridge the gaps inside a step and short
enough that an idle engine gives its cores back at once.  Either variable set in the environment
wins (``OMP_WAIT_POLICY=ACTIVE`` with ``GOMP_SPINCOUNT`` unset restores spinning).

**One computing thread.**  libgomp spins only while it manages no more threads than the process
may use CPUs; past that every wait is at once a sleep (its "throttled" spin count, whatever
``GOMP_SPINCOUNT`` says).  Each thread that runs a parallel region keeps a team of its own
(``OMP_NUM_THREADS - 1`` threads, parked), so a worker that builds its engine in an executor thread
and steps it in the engine thread manages 1 + 1 + 1 threads on 2 CPUs: every region of every
step then wakes a sleeping thread (Gemma 3 270M fp32, a batch-1 decode step stepped in a second
thread: ~54 -> ~61 ms, paired runs on the 2-core VM).  A thread that has computed and will not
again lets its team go with ``release_thread_team()``.
"""
from __future__ import annotations

import ctypes
import os

WAIT_POLICY = "PASSIVE"
SPIN_COUNT = 30_000


def configure() -> None:
    """Set the defaults above where the environment does not say otherwise (before ``import torch``)."""
    policy = os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    if policy.upper() == WAIT_POLICY:
        os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))


OMP_PAUSE_SOFT = 1  # OpenMP 5.0 ``omp_pause_soft``: threads go, settings stay


def release_thread_team() -> bool:
    """End the calling thread's OpenMP team (its parked worker threads exit; a later parallel region
    in this thread starts a new one), so that libgomp counts only the computing thread's team (see
    the module).  ``False`` where torch's OpenMP runtime is not libgomp or has no such call."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # the one torch loaded
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return pause(OMP_PAUSE_SOFT) == 0
