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

Leases of reservations for remote KV end in the engine thread (``expired_leases``); the owner of a
reservation stops its lease with ``keep_lease`` once it has seen the KV land, and learns there
and then, exactly, whether the lease had ended first (both sides hold ``_lease_lock``), so KV that
has landed is never taken for late and late KV never reaches the batch.

The engine fails for good -- the thread stops, every stream and every pending or later ``call``
fails at once with ``EngineFailed``, and ``on_fatal`` tells the worker -- when

* ``max_step_failures`` steps fail in a row (a step that raises ends the requests it had
  scheduled with an error, ``Engine.step``, and the engine goes on), or
* the watchdog finds one step or one command running longer than ``watchdog_s`` (the first step
  of each kind, prefill-sized or decode-only, ``FIRST_STEP_ALLOWANCE`` times that).  A hung
  thread cannot check itself, so a thread of its own watches; the hung step or command is
  abandoned (it may never return), and the ``call`` that waits for it fails with the rest.  This
  is also what bounds ``call``: every command waits only for steps and commands that are each
  bounded, and gets ``EngineFailed`` once one is not.  (A timeout on one call alone would be
  wrong: its ``fn`` could still run later, unseen -- reserve blocks nobody frees.)  Compiling the
  model and capturing CUDA graphs happen when the ``Engine`` is built, before the thread starts,
  outside the watchdog; the allowance covers what is still initialised lazily, on the first step
  that needs it (Triton kernels compiled on first use, oneDNN primitives, the first touch of the
  weights) -- and a decode worker's first local prefill may come long after its first decode.

A step that hangs holding the GIL stops the watchdog too; with ``hang_backstop`` a C timer
(``worker.hang_backstop``) ends the process then, ``BACKSTOP_GRACE_S`` after the watchdog's
longest bound (or a little later).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

from common.engine.core_turns import CoreTurns
from common.engine.engine import Engine, RanksOutOfStep, RequestOutput, StepFailed
from worker.config import FIRST_STEP_ALLOWANCE, MAX_STEP_FAILURES
from common.engine.request import Request
from common.engine.scheduler_output import SchedulerOutput
from worker.hang_backstop import HangBackstop

log = logging.getLogger(__name__)

# How much longer than the watchdog's longest bound the hang backstop waits: the watchdog's own time
# to notice, its thread perhaps descheduled on a loaded host (see worker.hang_backstop).
BACKSTOP_GRACE_S = 10.0


class EngineFailed(RuntimeError):
    """The engine thread has stopped (repeated step failures, hung, or shut down): nothing more runs."""


MOVE_SOON = "move soon"  # put into a stream whose worker drains: the stream is handed over soon


class HandOver(Exception):
    """Put into a stream whose worker drains: the stream ends after the outputs queued before it
    and moves to another worker (``decode_svc.generate``)."""


@dataclass(frozen=True, eq=False)
class _Work:
    """One step or command the engine thread is running (compared by identity)."""

    what: str
    began: float  # time.monotonic()
    deadline: float


class EngineThread:
    """Owns the engine thread; all engine access from async code goes through ``call``.

    ``watchdog_s``: the most one step or one command may take before the engine counts as hung
    (``None`` or 0: no bound).  ``hang_backstop`` (with a watchdog; one engine thread per process):
    the process exits if a step hangs so that not even the watchdog runs.  ``clock``: what lease
    deadlines are read against (time.monotonic's scale; tests move it)."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, max_step_failures: int = MAX_STEP_FAILURES,
                 watchdog_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 hang_backstop: bool = False, core_turns: CoreTurns | None = None):
        if max_step_failures < 1:
            raise ValueError(f"max_step_failures must be >= 1, got {max_step_failures}")
        if watchdog_s is not None and not watchdog_s >= 0:
            raise ValueError(f"watchdog_s must be >= 0 seconds (0: off), got {watchdog_s}")
        self.engine = engine
        self.loop = loop
        self.max_step_failures = max_step_failures
        self.watchdog_s = watchdog_s or None
        self.clock = clock
        self.core_turns = core_turns  # steps take turns with other workers' on these cores
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
        # Leases: reservations whose owner saw their KV land (their lease stops before the next
        # check), and those whose lease the engine thread ended (until they are freed).
        self._lease_lock = threading.Lock()
        self._keep: dict[str, Request] = {}
        self._lease_ended: dict[str, Request] = {}
        # Watchdog: what the engine thread runs now, and the command whose future waits for it.
        self._work: _Work | None = None
        self._command_future: asyncio.Future | None = None
        self._watch_until = math.inf  # when the watchdog wakes next (written by it only)
        self._watch_wake = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)
        self.hung = False  # the watchdog gave up on the engine thread
        self._kinds_begun: set[str] = set()  # kinds of step ("prefill", "decode") run so far
        self.backstop = HangBackstop(FIRST_STEP_ALLOWANCE * self.watchdog_s + BACKSTOP_GRACE_S) \
            if hang_backstop and self.watchdog_s is not None else None
        engine.on_scheduled = self._scheduled
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
        if self.watchdog_s is not None:
            self._watchdog.start()

    def stop(self) -> None:
        """Stop the thread after its current step; later calls fail at once (event loop thread).
        A hung thread is not waited for."""
        self._stopping = True
        self._commands.put(None)
        if self._thread.is_alive() and not self.hung:
            self._thread.join(timeout=10)
        self._watch_wake.set()
        if self.backstop is not None:
            self.backstop.disarm()
        if self.fatal_error is None:
            self._die(EngineFailed("the engine has stopped"), notify=False)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread between steps and return its result.  Raises
        ``EngineFailed`` at once if the engine thread has stopped, or when it stops before ``fn``
        has returned (with a watchdog, so this never waits unbounded)."""
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

    def announce_hand_over(self, request_ids) -> list[str]:
        """Tell the open streams of ``request_ids`` (after the outputs already queued in them) that
        they will be handed over (``MOVE_SOON``; event loop thread).  Returns their ids."""
        told = [r for r in request_ids if r in self._streams]
        for request_id in told:
            self._streams[request_id].put_nowait(MOVE_SOON)
        return told

    def hand_over(self, request_ids) -> list[str]:
        """End the open streams of ``request_ids`` after the outputs already queued in them (event
        loop thread; the requests themselves are aborted by their handlers).  Returns their ids."""
        handed = [r for r in request_ids if r in self._streams]
        for request_id in handed:
            self._streams[request_id].put_nowait(HandOver("this worker drains: the stream moves to another worker"))
        return handed

    def keep_lease(self, request: Request) -> bool:
        """The KV of ``request``'s reservation has all landed: stop its lease, so it never expires
        (the engine thread does so before it next looks at leases; ``finish_remote`` then takes
        it).  ``False`` if its lease has already ended: that KV is late, the reservation is given
        up (``on_lease_expired``).  Any thread; never waits for a step."""
        with self._lease_lock:
            if self._lease_ended.get(request.request_id) is request:
                return False
            self._keep[request.request_id] = request
            return True

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        failures = 0  # in a row
        last_end = None  # when the previous step ended, if work has been waiting since
        try:
            while not self._stopping and self.fatal_error is None:
                idle = engine.stalled or not engine.has_work()
                if idle:
                    last_end = None
                    if self.backstop is not None:
                        self.backstop.disarm()  # nothing may run for a long time now
                ran = self._drain_commands(block=idle)
                if ran is None:
                    return
                if self._settle_leases() or ran:  # the work may have changed
                    idle = engine.stalled or not engine.has_work()
                if idle:
                    self._publish()
                    continue
                began = time.perf_counter()
                if last_end is not None:
                    self.gap_seconds += began - last_end
                self._begin(f"step {engine.num_steps + 1}")  # its kind, hence its allowance: ``_scheduled``
                try:
                    with self.core_turns.turn() if self.core_turns else contextlib.nullcontext():
                        outputs = engine.step()
                    failed = None
                except RanksOutOfStep as exc:
                    self._die(exc)
                    return
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
                self._work = None
                if self.fatal_error is not None:
                    return  # the watchdog gave up on this step: every waiter has its error
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

    def _drain_commands(self, block: bool) -> bool | None:
        """Run queued commands; wait for one if ``block`` (at most until the next lease ends).
        Returns whether any ran; ``None`` once asked to stop, or failed."""
        ran = False
        while True:
            timeout = None
            if block:
                deadline = self.engine.scheduler.next_lease_deadline()
                if deadline is not None:
                    timeout = max(0.0, deadline - self.clock())
                    if timeout == 0.0:
                        return None if self._stopping else ran
            try:
                item = self._commands.get(block=block, timeout=timeout)
            except queue.Empty:
                return None if self._stopping else ran
            if item is None:
                return None
            fn, future = item
            self._command_future = future
            self._begin(f"call {getattr(fn, '__qualname__', fn)!s}")
            try:
                result = fn(self.engine)
            except Exception as exc:
                self._post(_set_exception, future, exc)
            else:
                self._post(_set_result, future, result)
            finally:
                self._work = self._command_future = None
            if self.fatal_error is not None:
                return None  # the watchdog gave up on this command
            self.engine.stalled = False  # the command may have made room or work
            ran = True
            block = False

    def _settle_leases(self) -> bool:
        """Stop the leases whose KV has landed, then end those that ran out (in that order, under
        the lease lock: see ``keep_lease``).  Returns whether any ran out."""
        scheduler = self.engine.scheduler
        with self._lease_lock:
            for request_id, request in self._keep.items():
                if scheduler.reservations.get(request_id) is request:
                    scheduler.end_lease(request_id)
            self._keep.clear()
            for request_id, request in list(self._lease_ended.items()):
                if scheduler.reservations.get(request_id) is not request:
                    del self._lease_ended[request_id]  # given up since: nothing can keep it any more
            expired = scheduler.expired_leases(now=self.clock())
            for request_id in expired:
                self._lease_ended[request_id] = scheduler.reservations[request_id]
        if not expired:
            return False
        self.engine.stalled = False
        log.warning("%d reservations for remote KV outlived their lease: %s", len(expired), expired[:8])
        if self.on_lease_expired is not None:
            self._post(self.on_lease_expired, expired)  # the owner frees them once no more bytes can land
        else:
            for request_id in expired:
                self.engine.abort(request_id)
        return True

    def _publish(self) -> None:
        """Swap in a fresh read-only snapshot of the engine's counters for other threads."""
        stats = self.engine.stats()
        stats.update(engine_steps=self.steps, engine_step_failures=self.step_failures,
                     engine_step_seconds=self.step_seconds, engine_gap_seconds=self.gap_seconds)
        self.snapshot = MappingProxyType(stats)

    def _begin(self, what: str, allowance: float = 1.0, began: float | None = None) -> None:
        """Engine thread: a step or command starts (at ``began``, default now); wake the watchdog
        if it must look sooner."""
        if self.watchdog_s is None:
            return
        began = time.monotonic() if began is None else began
        work = _Work(what, began, began + allowance * self.watchdog_s)
        self._work = work
        if self.backstop is not None:
            self.backstop.arm()
        if work.deadline < self._watch_until:
            self._watch_wake.set()

    def _scheduled(self, out: SchedulerOutput) -> None:
        """Engine thread, before a step's forward: the first step of each kind (prefill-sized or
        decode-only) gets ``FIRST_STEP_ALLOWANCE`` (what it runs first may be compiled or
        initialised now)."""
        if len(self._kinds_begun) == 2:
            return  # both kinds seen: nothing to look at on the steps that follow
        kind = "decode" if all(len(item.token_ids) == 1 for item in out.scheduled) else "prefill"
        if kind in self._kinds_begun:
            return
        self._kinds_begun.add(kind)
        work = self._work
        if work is not None:
            self._begin(f"{work.what} (the first {kind} step)", FIRST_STEP_ALLOWANCE, began=work.began)

    # ---- watchdog thread -------------------------------------------------------------------

    def _watch(self) -> None:
        """Sleep until what the engine thread runs now is due; if it is still the same step or
        command by then, the engine thread is hung: fail the engine."""
        while not self._stopping and self.fatal_error is None:
            work = self._work
            now = time.monotonic()
            if work is not None and work.deadline <= now:
                if self._work is work:
                    self._hung(work, now)
                    return
                continue
            self._watch_until = work.deadline if work is not None else math.inf
            self._watch_wake.clear()
            if self._work is not work:  # changed meanwhile: look again (see _begin)
                continue
            self._watch_wake.wait(None if work is None else work.deadline - now)
        self._watch_until = math.inf

    def _hung(self, work: _Work, now: float) -> None:
        self.hung = True
        if self.backstop is not None:
            self.backstop.disarm()  # the worker's own bounded exit takes over
        error = EngineFailed(f"the engine thread is hung: {work.what} has run for {now - work.began:.1f} s, over "
                             f"the watchdog's bound of {work.deadline - work.began:g} s")
        self._die(error)

    # ---- any thread ------------------------------------------------------------------------

    def _die(self, exc: BaseException, notify: bool = True) -> None:
        """Stop for good: fail every stream, every queued command (and the one running, which a
        hung thread may never finish) and every later one.  The first failure wins."""
        with self._closed:
            if self.fatal_error is not None:
                return
            self.fatal_error = exc
        if notify:
            log.error("engine thread stops: %s", exc)
        error = EngineFailed(f"engine failed: {exc}")
        running = self._command_future
        if running is not None:
            self._post(_set_exception, running, error)
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._post(_set_exception, item[1], error)
        self._watch_wake.set()
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
