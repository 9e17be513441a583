"""Waiting for a condition in tests: poll until it holds, bounded only so a hang becomes a failure.

The bound is never a claim about speed (a loaded machine may be slow); a test holds the condition
it needs and waits for it here, instead of sleeping and hoping.
"""
from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable

WAIT_S = 300.0  # turns a hang into a failure; far beyond anything a slow machine needs


def wait_until(condition: Callable[[], Any], what: str, timeout: float = WAIT_S, interval: float = 0.05) -> Any:
    """Call ``condition()`` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(interval)
    return value


async def until(condition: Callable[[], Any], what: str, timeout: float = WAIT_S, interval: float = 0.02) -> Any:
    """``wait_until`` on the event loop: ``condition`` may be a plain or a coroutine function."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert loop.time() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(interval)
