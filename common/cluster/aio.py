"""Small asyncio helpers shared by the services."""
from __future__ import annotations

import asyncio
from typing import Awaitable


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has really ended."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def run_service(main: Awaitable):
    """Run a service's main coroutine on uvloop when it is installed (the asyncio loop otherwise);
    returns what it returns."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(main)
