"""Runs an ``Engine`` in its own thread and bridges it to an asyncio event loop.

The model forward is blocking; running it on the event loop would stall every socket (HTTP
streams, UCX progress, Redis).  So the engine lives in one dedicated thread, which alone touches
the scheduler and block pool:

    event loop thread                          engine thread
    -----------------                          -------------
    await engine.call(fn)  --command queue-->  fn(engine) between two steps
    per-request asyncio.Queue <--call_soon_threadsafe--  outputs of engine.step()

``after_step`` hooks run in the engine thread right after each step (the prefill role uses one
to pin freshly computed blocks for shipping before anything can reuse them).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, Callable

from common.engine.engine import Engine, RequestOutput

log = logging.getLogger(__name__)


class EngineThread:
    """Owns the engine thread; all engine access from async code goes through ``call``."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.loop = loop
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self.after_step: list[Callable[[Engine, list[RequestOutput]], None]] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.steps = 0
        self.fatal_error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout=10)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread between steps and return its result."""
        future = self.loop.create_future()
        self._commands.put((fn, future))
        return await future

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """A queue that receives this request's ``RequestOutput``s (must be opened before adding it)."""
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            try:
                if not self._drain_commands(block=not engine.has_work()):
                    return
                if not engine.has_work():
                    continue
                outputs = engine.step()
                for hook in self.after_step:
                    hook(engine, outputs)
                self.steps += 1
                if outputs:
                    self.loop.call_soon_threadsafe(self._dispatch, outputs)
            except Exception as exc:  # a bug in a step: fail everything in flight, keep no zombie
                log.exception("engine step failed")
                self.fatal_error = exc
                self.loop.call_soon_threadsafe(self._fail_all, exc)
                return

    def _drain_commands(self, block: bool) -> bool:
        """Run queued commands; wait for one if ``block``.  False once asked to stop."""
        while True:
            try:
                item = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return not self._stopping
            if item is None:
                return False
            fn, future = item
            try:
                result = fn(self.engine)
            except Exception as exc:
                self.loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                self.loop.call_soon_threadsafe(_set_result, future, result)
            block = False

    # ---- event loop thread -----------------------------------------------------------------

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(exc)


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
