"""Freed activation memory stays in the process (``common.engine.heap_reuse``): a block a step
frees is not mapped and zeroed afresh by the kernel on the next step, in the thread the engine
runs in -- counted as the page faults of allocating, filling and freeing a 64 MB block again.
(The engine itself, Gemma 3 270M in a thread: ~300k page faults a round of 16 prompts before,
30-6000 after, the process's size the same.)"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.engine import heap_reuse

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

# In a fresh process: the settings are process-wide, and a thread keeps the arena it was given.
PROBE = """
import ctypes, resource, threading
{setup}
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []

def steps():  # a step's largest block (64 MB), allocated, filled and freed step after step
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(64 << 20)
        libc.memset(block, 1, 64 << 20)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

thread = threading.Thread(target=steps)  # a worker's engine runs in a thread of its own
thread.start()
thread.join()
print(sum(faults[1:]))  # the steps after the first
"""
# Pages the later steps map afresh at least under glibc's defaults (2 MiB pages, were transparent
# huge pages on for every mapping: 32 a step).
FRESH_FAULTS = 32


def faults_in_later_steps(setup: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(setup=setup)], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


def test_freed_blocks_are_reused_without_faulting_again():
    assert faults_in_later_steps("from common.engine import heap_reuse; heap_reuse.configure()") < FRESH_FAULTS
    assert faults_in_later_steps("") >= 5 * FRESH_FAULTS  # glibc's defaults: mapped afresh, step after step


def test_the_worker_entry_point_configures_it_before_its_threads_start():
    assert faults_in_later_steps("import worker.main") < FRESH_FAULTS


def test_a_setting_from_the_environment_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    applied = heap_reuse.configure()
    assert "MALLOC_ARENA_MAX" not in applied and "MALLOC_TRIM_THRESHOLD_" not in applied
    assert applied in ([], ["MALLOC_MMAP_THRESHOLD_"])  # [] without glibc
