"""Runs an ``Engine`` in its own thread and bridges it to an asyncio event loop.

The model forward is blocking; running it on the event loop would stall every socket (HTTP
streams, UCX progress, Redis).  So the engine lives in one dedicated thread, which alone touches
the scheduler and block pool:

    event loop thread                          engine thread
    -----------------                          -------------
    await engine.call(fn)  --command queue-->  fn(engine) between two steps
    per-request asyncio.Queue <--call_soon_threadsafe--  outputs of engine.step()
    engine_thread.snapshot  <--swapped after each step--  engine.stats() (never read the scheduler
                                                          from the event loop: it changes under it)

``after_step`` hooks run in the engine thread right after each step (the prefill role uses one
to pin freshly computed blocks for shipping before anything can reuse them).

When nothing can run (no requests, or only ones waiting for blocks held elsewhere) the thread
sleeps until a command arrives or a reservation's lease ends: an idle worker uses no CPU.

A step that raises ends the requests it had scheduled with an error (``Engine.step``) and the
engine goes on; ``max_step_failures`` failures in a row mean the engine is broken: the thread
stops, every stream and every pending or later ``call`` fails at once with ``EngineFailed``, and
``on_fatal`` tells the worker.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from types import MappingProxyType
from typing import Any, Callable, Mapping

from common.engine.engine import Engine, RequestOutput, StepFailed

log = logging.getLogger(__name__)


class EngineFailed(RuntimeError):
    """The engine thread has stopped (repeated step failures, or shut down): nothing more runs."""


class EngineThread:
    """Owns the engine thread; all engine access from async code goes through ``call``."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, max_step_failures: int = 3):
        if max_step_failures < 1:
            raise ValueError(f"max_step_failures must be >= 1, got {max_step_failures}")
        self.engine = engine
        self.loop = loop
        self.max_step_failures = max_step_failures
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self.after_step: list[Callable[[Engine, list[RequestOutput]], None]] = []
        # Event loop thread, with the ids of reservations whose lease ended (default: the engine
        # thread aborts them at once).
        self.on_lease_expired: Callable[[list[str]], None] | None = None
        self.on_fatal: Callable[[BaseException], None] | None = None  # event loop thread
        self._stopping = False
        self._closed = threading.Lock()  # orders "no more commands" against queueing one
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.steps = 0
        self.step_failures = 0  # all of them, for the stats
        # Time accounting (in the stats): seconds from the start of a step to its outputs handed
        # to the event loop, and seconds between two steps while work was waiting (commands,
        # waiting for the GIL: the engine thread / event loop handoff's cost).
        self.step_seconds = 0.0
        self.gap_seconds = 0.0
        self.fatal_error: BaseException | None = None
        self.snapshot: Mapping[str, Any] = MappingProxyType({})
        self._publish()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread after its current step; later calls fail at once (event loop thread)."""
        self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout=10)
        if self.fatal_error is None:
            self._die(EngineFailed("the engine has stopped"), notify=False)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread between steps and return its result.  Raises
        ``EngineFailed`` at once if the engine thread has stopped (or stops before running it)."""
        future = self.loop.create_future()
        with self._closed:
            if self.fatal_error is not None:
                raise EngineFailed(f"engine failed: {self.fatal_error}")
            self._commands.put((fn, future))
        return await future

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """A queue that receives this request's ``RequestOutput``s (must be opened before adding it),
        or the exception that ended it."""
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        if self.fatal_error is not None:
            stream.put_nowait(EngineFailed(f"engine failed: {self.fatal_error}"))
        return stream

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        failures = 0  # in a row
        last_end = None  # when the previous step ended, if work has been waiting since
        try:
            while not self._stopping:
                if not engine.has_work() or engine.stalled:
                    last_end = None
                if not self._drain_commands(block=not engine.has_work() or engine.stalled):
                    return
                self._expire_leases()
                if not engine.has_work() or engine.stalled:
                    self._publish()
                    continue
                began = time.perf_counter()
                if last_end is not None:
                    self.gap_seconds += began - last_end
                try:
                    outputs = engine.step()
                    failed = None
                except StepFailed as exc:
                    outputs, failed = [], exc
                except Exception as exc:  # outside the forward: the scheduler itself
                    log.exception("engine step failed")
                    outputs, failed = [], StepFailed(exc, [])
                try:
                    for hook in self.after_step:
                        hook(engine, outputs)
                except Exception as exc:
                    log.exception("after-step hook failed")
                    failed = failed or StepFailed(exc, [])
                self.steps += 1
                if outputs:
                    self._post(self._dispatch, outputs)
                if failed is None:
                    failures = 0
                else:
                    failures += 1
                    self.step_failures += 1
                    if failed.request_ids:
                        self._post(self._fail_requests, failed.request_ids, failed)
                    if failures >= self.max_step_failures:
                        self._die(EngineFailed(f"{failures} engine steps failed in a row, the last: {failed}"))
                        return
                self._publish()
                self.step_seconds += time.perf_counter() - began
                last_end = time.perf_counter()
        except Exception as exc:  # a bug in the loop itself
            log.exception("engine thread failed")
            self._die(exc)

    def _drain_commands(self, block: bool) -> bool:
        """Run queued commands; wait for one if ``block`` (at most until the next lease ends).
        False once asked to stop."""
        while True:
            timeout = None
            if block:
                deadline = self.engine.scheduler.next_lease_deadline()
                if deadline is not None:
                    timeout = max(0.0, deadline - time.monotonic())
                    if timeout == 0.0:
                        return not self._stopping
            try:
                item = self._commands.get(block=block, timeout=timeout)
            except queue.Empty:
                return not self._stopping
            if item is None:
                return False
            fn, future = item
            try:
                result = fn(self.engine)
            except Exception as exc:
                self._post(_set_exception, future, exc)
            else:
                self._post(_set_result, future, result)
            self.engine.stalled = False  # the command may have made room or work
            block = False

    def _expire_leases(self) -> None:
        expired = self.engine.scheduler.expired_leases()
        if not expired:
            return
        self.engine.stalled = False
        log.warning("%d reservations for remote KV outlived their lease: %s", len(expired), expired[:8])
        if self.on_lease_expired is not None:
            self._post(self.on_lease_expired, expired)  # the owner frees them once no more bytes can land
        else:
            for request_id in expired:
                self.engine.abort(request_id)

    def _publish(self) -> None:
        """Swap in a fresh read-only snapshot of the engine's counters for other threads."""
        stats = self.engine.stats()
        stats.update(engine_steps=self.steps, engine_step_failures=self.step_failures,
                     engine_step_seconds=self.step_seconds, engine_gap_seconds=self.gap_seconds)
        self.snapshot = MappingProxyType(stats)

    def _die(self, exc: BaseException, notify: bool = True) -> None:
        """Stop for good: fail every stream, every queued command and every later one."""
        if notify:
            log.error("engine thread stops: %s", exc)
        with self._closed:
            self.fatal_error = exc
        error = EngineFailed(f"engine failed: {exc}")
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._post(_set_exception, item[1], error)
        self._post(self._fail_all, error, notify)

    def _post(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the event loop (dropped once the loop is closed: nobody waits)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    # ---- event loop thread -----------------------------------------------------------------

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)

    def _fail_requests(self, request_ids: list[str], exc: BaseException) -> None:
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(exc)

    def _fail_all(self, exc: BaseException, notify: bool = True) -> None:
        for stream in self._streams.values():
            stream.put_nowait(exc)
        if notify and self.on_fatal is not None:
            self.on_fatal(exc)


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
