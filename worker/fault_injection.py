"""Tests only: engine steps that fail or hang on cue, named by environment variables.

``PDSERVE_TEST_FAIL_STEPS`` names engine steps (counted from 1, only steps that compute something)
that raise: ``3`` the 3rd, ``3-5`` the 3rd to the 5th, ``3-`` every one from the 3rd on; several
joined by commas.  ``PDSERVE_TEST_HANG_STEPS`` names, the same way, steps that never return (a hung
engine thread: what the watchdog is for); with ``PDSERVE_TEST_HANG_HOLDS_GIL=1`` they hang in native
code that keeps the GIL (no other thread of the process runs: what the hang backstop is for).
``PDSERVE_TEST_STEP_DELAY_S`` makes every such step take that many seconds longer (a slow device:
streams that stay in flight long enough for a test to act while they do).
``PDSERVE_TEST_STUCK_EXECUTOR=1`` keeps one thread of the event loop's default executor busy for
good, as a wait on a hung device's fence would (``kvtransfer.ordering``).
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import threading
import time
from typing import Callable, Mapping

log = logging.getLogger(__name__)


def _step_ranges(spec: str) -> list[tuple[int, float]]:
    ranges = []
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        ranges.append((int(first), (int(last) if last else float("inf")) if dash else int(first)))
    return ranges


def fault_injector_from_env(env=os.environ) -> Callable[[int], None] | None:
    """The ``Engine.fault_injector`` those variables ask for, or ``None`` when none is set."""
    fail = env.get("PDSERVE_TEST_FAIL_STEPS", "").strip()
    hang = env.get("PDSERVE_TEST_HANG_STEPS", "").strip()
    delay_s = float(env.get("PDSERVE_TEST_STEP_DELAY_S", "").strip() or 0)
    if not fail and not hang and delay_s <= 0:
        return None
    fail_ranges = _step_ranges(fail) if fail else []
    hang_ranges = _step_ranges(hang) if hang else []
    hold_gil = env.get("PDSERVE_TEST_HANG_HOLDS_GIL", "").strip() == "1"
    if fail:
        log.warning("fault injection: engine steps %s will fail (PDSERVE_TEST_FAIL_STEPS)", fail)
    if hang:
        log.warning("fault injection: engine steps %s will hang (PDSERVE_TEST_HANG_STEPS)%s", hang,
                    " holding the GIL" if hold_gil else "")
    if delay_s > 0:
        log.warning("fault injection: every engine step takes %.3f s longer (PDSERVE_TEST_STEP_DELAY_S)", delay_s)

    def inject(step: int) -> None:
        if delay_s > 0:
            time.sleep(delay_s)
        if any(lo <= step <= hi for lo, hi in hang_ranges):
            log.warning("fault injection: engine step %d hangs (PDSERVE_TEST_HANG_STEPS=%s)", step, hang)
            if hold_gil:
                libc = ctypes.PyDLL(None)  # a PyDLL call keeps the GIL
                while True:
                    libc.sleep(3600)
            threading.Event().wait()
        if any(lo <= step <= hi for lo, hi in fail_ranges):
            raise RuntimeError(f"injected fault in step {step} (PDSERVE_TEST_FAIL_STEPS={fail})")

    return inject


def stick_an_executor_thread(loop: asyncio.AbstractEventLoop, env: Mapping[str, str] = os.environ) -> None:
    """With ``PDSERVE_TEST_STUCK_EXECUTOR=1``, keep one thread of ``loop``'s default executor busy
    for good (the interpreter's shutdown would wait for it forever)."""
    if env.get("PDSERVE_TEST_STUCK_EXECUTOR", "").strip() == "1":
        log.warning("fault injection: a default-executor thread is stuck for good (PDSERVE_TEST_STUCK_EXECUTOR)")
        loop.run_in_executor(None, threading.Event().wait)
