"""``GrammarCompiler``: compiles once per spec (concurrent requests share the compile, the result
and a rejection are cached), a compile over its time limit fails only the requests waiting for
it (and is tried again later), a request whose compile no thread started in time is told the
compiler is busy (not that its grammar is bad), and the event loop and other requests go on meanwhile."""
import asyncio
import threading

import pytest

from common.engine.structured.backend import GrammarError
from common.engine.structured.compiler import CompilerBusy, GrammarCompiler
from common.engine.structured.spec import StructuredOutput


class Backend:
    """Compiles instantly, except ``slow`` regexes (held until released) and ``bad`` ones (refused)."""

    def __init__(self):
        self.compiled: list[str] = []
        self.release = threading.Event()
        self.held = {"first": threading.Event(), "second": threading.Event()}  # held until set

    def compile(self, spec):
        self.compiled.append(spec.value)
        if spec.value == "slow":
            self.release.wait(30)
        if spec.value in self.held:
            self.held[spec.value].wait(30)
        if spec.value == "bad":
            raise GrammarError(f"{spec.field}: bad regex")
        return ("compiled", spec.value)


def regex(value):
    return StructuredOutput("regex", value)


def test_each_spec_compiles_once_and_rejections_are_cached():
    backend = Backend()
    compiler = GrammarCompiler(lambda: backend, timeout_s=5)
    assert compiler.compile(regex("a")) == compiler.compile(regex("a")) == ("compiled", "a")
    for _ in range(2):
        with pytest.raises(GrammarError, match="^response_format: bad regex"):
            compiler.compile(regex("bad"))
    assert backend.compiled == ["a", "bad"] and compiler.hits == 2


async def test_a_cached_grammar_is_answered_after_its_compiles_time_limit_has_passed():
    backend = Backend()
    compiler = GrammarCompiler(lambda: backend, timeout_s=0.2)
    assert await compiler.compile_async(regex("a")) == ("compiled", "a")
    await asyncio.sleep(0.3)  # (its compile started more than the limit ago)
    assert await compiler.compile_async(regex("a")) == ("compiled", "a") == compiler.compile(regex("a"))
    assert backend.compiled == ["a"]
    compiler.close()


async def test_a_slow_compile_times_out_alone_and_is_tried_again():
    backend = Backend()
    compiler = GrammarCompiler(lambda: backend, timeout_s=0.3, threads=2)
    slow = asyncio.ensure_future(compiler.compile_async(regex("slow")))
    # Other requests compile and the event loop runs while the slow one is held.
    assert await compiler.compile_async(regex("fast")) == ("compiled", "fast")
    with pytest.raises(GrammarError, match="took longer than 0.3 s to compile"):
        await slow
    backend.release.set()  # the held compile ends in its thread; a timed-out spec is not cached
    assert await compiler.compile_async(regex("slow")) == ("compiled", "slow")
    assert backend.compiled.count("slow") == 2
    compiler.close()


async def test_a_grammar_no_thread_started_in_time_is_busy_not_refused_and_is_dropped_unstarted():
    backend = Backend()
    compiler = GrammarCompiler(lambda: backend, timeout_s=0.3, threads=1)
    slow = asyncio.ensure_future(compiler.compile_async(regex("slow")))
    while "slow" not in backend.compiled:  # (the one thread holds it)
        await asyncio.sleep(0.01)
    with pytest.raises(CompilerBusy, match="no grammar compile thread was free within 0.3 s"):
        await compiler.compile_async(regex("queued"))  # (behind the slow one, on the one thread)
    with pytest.raises(GrammarError, match="took longer than 0.3 s"):
        await slow
    backend.release.set()
    assert await compiler.compile_async(regex("queued")) == ("compiled", "queued")
    assert backend.compiled == ["slow", "queued"]  # the first "queued", which no request waited for, never ran
    compiler.close()


async def test_the_time_limit_counts_from_the_compiles_start_not_from_its_wait_for_a_thread():
    """The second grammar waits 0.7 s for the one thread, then compiles for 0.5 s: 1.2 s after it was
    asked for, within its 1 s from its start (it was refused at 1 s, a valid grammar as a 400)."""
    backend = Backend()
    compiler = GrammarCompiler(lambda: backend, timeout_s=1.0, threads=1)
    first = asyncio.ensure_future(compiler.compile_async(regex("first")))
    while "first" not in backend.compiled:  # (the one thread holds it)
        await asyncio.sleep(0.01)
    second = asyncio.ensure_future(compiler.compile_async(regex("second")))
    await asyncio.sleep(0.7)
    backend.held["first"].set()
    assert await first == ("compiled", "first")
    await asyncio.sleep(0.5)
    backend.held["second"].set()
    assert await second == ("compiled", "second")
    compiler.close()


def test_a_backend_that_cannot_be_built_is_a_grammar_error_naming_the_field():
    def no_tokenizer():
        raise ValueError("structured output needs the model's tokenizer")

    with pytest.raises(GrammarError, match="^tools: structured output needs"):
        GrammarCompiler(no_tokenizer).compile(StructuredOutput("json_object", field="tools"))


async def test_building_the_backend_does_not_count_against_the_compile_time_limit():
    """Converting a large vocabulary takes seconds, once: the first request waits for it without
    timing out (the limit is the grammar's), and the event loop runs meanwhile."""
    backend, built = Backend(), threading.Event()

    def slow_build():
        built.wait(30)
        return backend

    compiler = GrammarCompiler(slow_build, timeout_s=0.1)
    first = asyncio.ensure_future(compiler.compile_async(regex("a")))
    await asyncio.sleep(0.3)  # past the time limit, while the backend is still being built
    assert not first.done()
    built.set()
    assert await first == ("compiled", "a")
    compiler.close()


async def test_prepare_builds_the_backend_once_before_any_compile_and_says_why_it_cannot():
    """Servers build it before they serve: the first grammar then never waits for it (nor stalls
    the process while it is built)."""
    builds = []
    compiler = GrammarCompiler(lambda: builds.append(1) or Backend())
    assert not compiler.backend_ready
    assert await compiler.prepare() is None and compiler.backend_ready and builds == [1]
    assert compiler.compile(regex("a")) == ("compiled", "a") and builds == [1]

    def no_tokenizer():
        raise ValueError("structured output needs the model's tokenizer")

    assert await GrammarCompiler(no_tokenizer).prepare() == "structured output needs the model's tokenizer"
    compiler.close()

