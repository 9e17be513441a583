"""Compiles grammars off the engine thread and off the event loop, cached by spec, time-bounded.

    compiled = await compiler.compile_async(spec)   # a worker or gateway handler: waits alone
    compiled = compiler.compile(spec)               # the offline engine

A spec compiles at most once at a time (concurrent requests for it share the compile), the result
stays in an LRU cache of ``cache_size`` entries, and a spec the backend rejects is remembered as
rejected too.  A compile that takes longer than ``timeout_s`` from its start fails the requests
that wait for it with ``GrammarError`` (the backend's own resource limits end the compile itself soon
after).  A compile that no thread has started within ``timeout_s`` (the threads busy with other
grammars) fails its requests with ``CompilerBusy`` instead -- a grammar that may well be fine, to try
again shortly, not one to refuse -- and is dropped unstarted once no request waits for it.

Compile threads have deep stacks (``COMPILE_STACK_BYTES``): llguidance checks a grammar by recursing
once per link of a chain of rules or ``$ref`` definitions, and a few thousand links -- a 40 KB body
-- overflowed a thread's usual 8 MB, a segfault that took the gateway down with every request in it.

The backend is built once, in a compile thread: by ``prepare()`` where a server starts, before it
serves (converting a 262k-token vocabulary takes seconds, much of them holding the GIL: built at
the first grammar, it stalled every stream of the process and its heartbeat), else at the first
compile (the offline engine).  The time limit counts from when the backend is ready.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
from typing import Any, Callable

from common.engine.structured.backend import BACKENDS, CompiledGrammar, GrammarBackend, GrammarError
from common.engine.structured.spec import StructuredOutput

DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_SIZE = 256
COMPILE_THREADS = 2
# Reserved, not used: only the pages a compile touches take memory.  A chain of 30 000 Lark rules,
# or of 19 000 $refs (20 000: llguidance refuses the schema as too large), fits; the backends bound
# what a grammar may define below that (llguidance_backend.MAX_GRAMMAR_RULES).
COMPILE_STACK_BYTES = 256 << 20
_stack_size_lock = threading.Lock()


class CompilerBusy(RuntimeError):
    """No compile thread started the grammar within the time limit: they were busy with others' (a 503
    to retry, where a ``GrammarError`` is a 400 about the grammar itself)."""


class _Job:
    """One spec's compile: its result (``future``), when a thread started it (``started``: a future of
    ``time.monotonic()``), and how many requests wait for it now."""

    def __init__(self) -> None:
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.started: concurrent.futures.Future = concurrent.futures.Future()
        self.waiters = 0

    def run(self, compile_spec: Callable[[], CompiledGrammar]) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # dropped before a thread took it
        self.started.set_result(time.monotonic())
        try:
            self.future.set_result(compile_spec())
        except BaseException as exc:  # (a GrammarError: the rejection is cached with the spec)
            self.future.set_exception(exc)


class _DeepStackPool(concurrent.futures.ThreadPoolExecutor):
    """A thread pool whose threads get ``COMPILE_STACK_BYTES`` of stack (``threading.stack_size``
    is the process's setting for threads started next: set around the submit that may start one)."""

    def submit(self, fn, /, *args, **kwargs):
        with _stack_size_lock:
            previous = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                return super().submit(fn, *args, **kwargs)
            finally:
                threading.stack_size(previous)


class GrammarCompiler:
    """``make_backend``: builds the backend (once, in a compile thread)."""

    def __init__(self, make_backend: Callable[[], GrammarBackend], *, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 cache_size: int = DEFAULT_CACHE_SIZE, threads: int = COMPILE_THREADS):
        self._make_backend = make_backend
        self._backend: concurrent.futures.Future | None = None  # built once, in a compile thread
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._pool = _DeepStackPool(threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        # spec key -> its compile (a future of the compiled grammar or of its GrammarError), most recent last
        self._cache: collections.OrderedDict[tuple, _Job] = collections.OrderedDict()
        self.compiles = 0
        self.hits = 0

    def _job(self, spec: StructuredOutput) -> _Job:
        """The spec's compile (cached, or submitted now), with one more request waiting for it."""
        key = spec.cache_key
        with self._lock:
            job = self._cache.get(key)
            if job is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            else:
                job = _Job()
                self._pool.submit(job.run, lambda: self._compile(spec))
                self.compiles += 1
                self._cache[key] = job
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            job.waiters += 1
            return job

    def _left(self, spec: StructuredOutput, job: _Job, outcome: str) -> None:
        """A request stopped waiting for ``job`` (``outcome``: "done", "busy", "timeout").  A compile
        that ran out of time is not cached as such: the next request may try again (once the
        backend's own limits ended the first, it fails or finishes fast); one no thread started is
        dropped when no request waits for it any more."""
        with self._lock:
            job.waiters -= 1
            cached = self._cache.get(spec.cache_key) is job
            if outcome == "timeout" and cached and not job.future.done():
                del self._cache[spec.cache_key]
            elif outcome == "busy" and not job.waiters and job.future.cancel():
                if cached:
                    del self._cache[spec.cache_key]

    def _backend_future(self) -> concurrent.futures.Future:
        with self._lock:
            if self._backend is None:
                self._backend = self._pool.submit(self._make_backend)
            return self._backend

    async def prepare(self) -> str | None:
        """Build the backend now (a server does, before it serves: see the module docstring).
        Returns why it cannot be built (no tokenizer, the backend not installed: each request with
        a grammar is then refused with that reason), else ``None``."""
        try:
            await asyncio.wrap_future(self._backend_future())
        except Exception as exc:  # (any failure: the server still serves what needs no grammar)
            return str(exc) if isinstance(exc, (ValueError, RuntimeError)) else f"{type(exc).__name__}: {exc}"
        return None

    @property
    def backend_ready(self) -> bool:
        """Whether the backend has been built (or failed to be)."""
        with self._lock:
            return self._backend is not None and self._backend.done()

    def _backend_for(self, spec: StructuredOutput) -> GrammarBackend:
        try:
            return self._backend_future().result()
        except (ValueError, RuntimeError) as exc:  # no tokenizer; the backend not installed
            raise GrammarError(f"{spec.field}: {exc}") from None

    def _compile(self, spec: StructuredOutput) -> CompiledGrammar:
        return self._backend_for(spec).compile(spec)

    def _timed_out(self, spec: StructuredOutput) -> GrammarError:
        return GrammarError(f"{spec.field}: the {spec.kind} took longer than {self.timeout_s:g} s to compile")

    def _busy(self, spec: StructuredOutput) -> CompilerBusy:
        return CompilerBusy(f"{spec.field}: no grammar compile thread was free within {self.timeout_s:g} s "
                            "(others' grammars held them); retry shortly")

    def _time_left(self, job: _Job) -> float:
        """What is left of the time limit of a started compile."""
        return max(0.0, self.timeout_s - (time.monotonic() - job.started.result()))

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar; raises ``GrammarError``, or ``CompilerBusy``."""
        self._backend_for(spec)  # built first: its one-off cost is not the compile's
        job, outcome = self._job(spec), "done"
        try:
            try:
                job.started.result(timeout=self.timeout_s)
            except concurrent.futures.TimeoutError:
                outcome = "busy"
                raise self._busy(spec) from None
            try:
                return job.future.result(timeout=self._time_left(job))
            except concurrent.futures.TimeoutError:
                outcome = "timeout"
                raise self._timed_out(spec) from None
        finally:
            self._left(spec, job, outcome)

    async def compile_async(self, spec: StructuredOutput) -> CompiledGrammar:
        """As ``compile``, awaited: the event loop and other requests go on meanwhile.  Cancelling
        the caller does not cancel a compile other requests may share."""
        try:  # built first: its one-off cost is not the compile's
            await asyncio.shield(asyncio.wrap_future(self._backend_future()))
        except (ValueError, RuntimeError) as exc:
            raise GrammarError(f"{spec.field}: {exc}") from None
        job, outcome = self._job(spec), "done"
        try:
            if job.future.done():  # cached: its result at once (its start may lie past the time limit)
                return job.future.result()
            try:
                async with asyncio.timeout(self.timeout_s):
                    await asyncio.shield(asyncio.wrap_future(job.started))
            except TimeoutError:
                outcome = "busy"
                raise self._busy(spec) from None
            try:
                async with asyncio.timeout(self._time_left(job)):
                    return await asyncio.shield(asyncio.wrap_future(job.future))
            except TimeoutError:
                outcome = "timeout"
                raise self._timed_out(spec) from None
        finally:
            self._left(spec, job, outcome)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def make_backend(name: str, tokenizer: Any, vocab_size: int) -> GrammarBackend:
    """The backend ``name`` over a Hugging Face ``tokenizer``; ``ValueError`` for an unknown name,
    ``RuntimeError`` when the backend is not installed."""
    if name == "llguidance":
        from common.engine.structured.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size)
    if name == "xgrammar":
        try:
            from common.engine.structured.xgrammar_backend import XGrammarBackend
        except ImportError as exc:
            raise RuntimeError("the xgrammar backend needs the 'xgrammar' extra: pip install 'pdserve[xgrammar]'"
                               ) from exc
        return XGrammarBackend(tokenizer, vocab_size)
    raise ValueError(f"unknown structured output backend {name!r}; choose from {', '.join(BACKENDS)}")
