"""The engine thread: a failing step ends only its own requests; repeated failures stop the engine
and every waiter gets an error at once; so does a step or a command that hangs (the watchdog); with
nothing runnable the thread sleeps (no empty steps) until work arrives or a lease ends."""
import asyncio
import fcntl
import os
import threading
import time

import pytest

from common.engine.config import EngineConfig
from common.engine.core_turns import CoreTurns
from common.engine.engine import Engine, StepFailed
from worker.engine_thread import FIRST_STEP_ALLOWANCE, EngineFailed, EngineThread
from tests.support.checkpoints import tiny_llama_config, write_checkpoint

WAIT = 120.0


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The engine thread computes next to the event loop in this process: on a shared 2-core host
    more torch threads only fight over the cores (and the GIL)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)  # generous bound on anything awaited
PARAMS = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tiny_llama_config(max_position_embeddings=128), tmp_path_factory.mktemp("llama"))


def make_engine(checkpoint, **config) -> Engine:
    return Engine(EngineConfig(model=str(checkpoint), block_size=4, **{"num_blocks": 32, **config}),
                  load_tokenizer=False)


@pytest.fixture
async def running(checkpoint):
    """Build an engine thread (``running(**engine_config, max_step_failures=n)``), stopped afterwards."""
    threads = []

    def start(max_step_failures=3, watchdog_s=None, core_turns=None, **config):
        thread = EngineThread(make_engine(checkpoint, **config), asyncio.get_running_loop(), max_step_failures,
                              watchdog_s=watchdog_s, core_turns=core_turns)
        thread.start()
        threads.append(thread)
        return thread

    yield start
    for thread in threads:
        thread.stop()


async def generate(thread: EngineThread, rid: str, prompt: list[int], params=PARAMS) -> list[int]:
    """Run one request through the thread; returns its tokens or raises what ended it."""
    stream = thread.open_stream(rid)
    try:
        await thread.call(lambda e: e.add_request(prompt, params, rid))
        tokens = []
        while True:
            item = await asyncio.wait_for(stream.get(), WAIT)
            if isinstance(item, BaseException):
                raise item
            tokens += item.new_token_ids
            if item.finished:
                return tokens
    finally:
        thread.close_stream(rid)


def faults(*steps):
    def inject(step):
        if step in steps:
            raise RuntimeError(f"injected fault in step {step}")
    return inject


async def test_a_failed_step_ends_its_requests_and_the_engine_goes_on(running, checkpoint):
    thread = running()
    thread.engine.fault_injector = faults(2)
    with pytest.raises(StepFailed, match="injected fault in step 2"):
        await generate(thread, "a", [5, 6, 7])  # step 1: prompt; step 2: its first decode fails
    assert await generate(thread, "b", [5, 6, 7]) == make_engine(checkpoint).generate([[5, 6, 7]], PARAMS)[0].token_ids
    stats = await thread.call(lambda e: (e.scheduler.check_integrity(), e.stats())[1])
    assert stats["num_free_blocks"] == stats["num_blocks"]  # a's blocks came back
    assert thread.fatal_error is None and thread.step_failures == 1


async def test_repeated_failures_stop_the_engine_and_every_waiter_gets_an_error(running):
    thread = running(max_step_failures=2, max_num_seqs=1)
    failed = asyncio.Event()
    thread.on_fatal = lambda exc: failed.set()
    thread.engine.fault_injector = faults(1, 2)
    # One request per step (max_num_seqs=1): a and b fail in steps 1 and 2; c waits behind them.
    results = await asyncio.wait_for(asyncio.gather(
        *(generate(thread, rid, [5, 6, 7]) for rid in "abc"), return_exceptions=True), WAIT)
    assert sorted(type(r).__name__ for r in results) == ["EngineFailed", "StepFailed", "StepFailed"]
    await asyncio.wait_for(failed.wait(), WAIT)
    with pytest.raises(EngineFailed):  # a later call fails at once instead of waiting forever
        await asyncio.wait_for(thread.call(lambda e: None), WAIT)
    stream = thread.open_stream("late")
    assert isinstance(stream.get_nowait(), EngineFailed)


async def test_a_step_that_leaves_tensor_parallel_ranks_out_of_step_stops_the_engine_at_once(running):
    """Not a failure to count and go on from (``test_tensor_parallel.py`` makes one on rank 0)."""
    thread = running(max_step_failures=3)
    failed = asyncio.Event()
    thread.on_fatal = lambda exc: failed.set()
    thread.engine.runner.followers_out_of_step = True  # as rank 0 after a failure once the step was sent
    thread.engine.fault_injector = faults(1)
    with pytest.raises(EngineFailed, match="RanksOutOfStep|rank 0"):
        await generate(thread, "a", [5, 6, 7])
    await asyncio.wait_for(failed.wait(), WAIT)
    assert thread.step_failures == 0


async def test_calls_after_stop_fail_at_once(running):
    thread = running()
    thread.stop()
    with pytest.raises(EngineFailed):
        await asyncio.wait_for(thread.call(lambda e: None), WAIT)


async def test_nothing_runnable_means_no_steps_until_a_lease_ends(running):
    """A reservation holds most of the pool, so a new request waits: the thread must sleep (the
    old loop called empty steps back to back), then wake when the lease ends and run it."""
    thread = running(num_blocks=8)

    def reserve(engine):
        request = engine.make_request(list(range(10, 34)), PARAMS, "remote")  # 6 of 8 blocks
        return engine.scheduler.reserve_remote(request, lease_s=3600)

    assert await thread.call(reserve) is not None
    waiting = asyncio.ensure_future(generate(thread, "local", list(range(40, 56))))  # needs 5 blocks
    while (await thread.call(lambda e: e.stats()))["num_waiting"] == 0:
        await asyncio.sleep(0.01)
    steps = thread.steps
    time.sleep(0.3)  # the event loop stays away: whatever the thread does now, it does alone
    assert thread.steps - steps <= 1, f"{thread.steps - steps} empty steps while nothing could run"
    assert not waiting.done()
    # Shorten the lease: the thread must wake by itself when it ends, free the reservation (no
    # transfer owns it here) and run the request.
    await thread.call(lambda e: e.scheduler.handoff.decode.leases.update(remote=time.monotonic() + 0.2))
    assert len(await asyncio.wait_for(waiting, WAIT)) == PARAMS["max_tokens"]
    stats = await thread.call(lambda e: e.stats())
    assert stats["num_waiting_for_remote_kv"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


# ---- the watchdog -----------------------------------------------------------------------------
# Each test holds the engine thread inside one step or command (a threading.Event only the test
# sets), so the bound below is the only clock: nothing else the thread does comes near it.
WATCHDOG_S = 1.0


class Hold:
    """Blocks the engine thread where it is called, until the test lets go."""

    def __init__(self):
        self.entered = threading.Event()
        self.released = threading.Event()

    def __call__(self, *_args) -> None:
        self.entered.set()
        self.released.wait()

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, WAIT), "the engine thread never got there"


def fatal_event(thread: EngineThread) -> tuple[asyncio.Event, list[BaseException]]:
    failed, errors = asyncio.Event(), []

    def on_fatal(exc):
        errors.append(exc)
        failed.set()

    thread.on_fatal = on_fatal
    return failed, errors


async def test_a_hung_step_fails_the_engine_and_every_waiter_gets_an_error(running):
    thread = running(watchdog_s=WATCHDOG_S)
    failed, errors = fatal_event(thread)
    hold = Hold()
    thread.engine.fault_injector = lambda step: hold() if step == 1 else None
    try:
        in_step = asyncio.ensure_future(generate(thread, "a", [5, 6, 7]))
        await hold.wait_entered()
        behind = asyncio.ensure_future(generate(thread, "b", [5, 6, 7]))  # its add waits for the step
        call = asyncio.ensure_future(thread.call(lambda e: e.stats()))
        await asyncio.wait_for(failed.wait(), WAIT)
        assert "hung" in str(errors[0]) and "step 1" in str(errors[0]), errors
        assert thread.hung and thread.fatal_error is not None  # what the worker's /health reads
        for waiter in (in_step, behind, call):
            with pytest.raises(EngineFailed, match="hung"):
                await asyncio.wait_for(waiter, WAIT)
        with pytest.raises(EngineFailed):  # a later call fails at once
            await asyncio.wait_for(thread.call(lambda e: None), WAIT)
        assert isinstance(thread.open_stream("late").get_nowait(), EngineFailed)
    finally:
        hold.released.set()


async def test_a_hung_command_fails_the_engine_and_the_call_waiting_for_it(running):
    thread = running(watchdog_s=WATCHDOG_S)
    failed, errors = fatal_event(thread)
    hold = Hold()
    try:
        stuck = asyncio.ensure_future(thread.call(hold))
        await hold.wait_entered()
        behind = asyncio.ensure_future(thread.call(lambda e: None))
        await asyncio.wait_for(failed.wait(), WAIT)
        assert "hung" in str(errors[0]) and "call" in str(errors[0]), errors
        for waiter in (stuck, behind):
            with pytest.raises(EngineFailed, match="hung"):
                await asyncio.wait_for(waiter, WAIT)
    finally:
        hold.released.set()
    # Let go, the abandoned command returns into nothing: the thread stops, no step runs.
    await asyncio.to_thread(thread._thread.join, WAIT)
    assert not thread._thread.is_alive() and thread.steps == 0


async def test_the_watchdog_leaves_an_idle_engine_alone(running):
    """It bounds steps and commands, not the time without any (nothing runs here at all)."""
    thread = running(watchdog_s=0.05)
    await asyncio.sleep(0.5)  # ten bounds with nothing to do
    assert thread.fatal_error is None and not thread.hung


async def test_the_first_step_of_each_kind_gets_the_allowance(running):
    """What a step runs first may be compiled or initialised then: a decode worker's first decode
    (a landed remote prompt) and, perhaps much later, its first local prefill each get
    FIRST_STEP_ALLOWANCE times the bound; later steps of either kind get the bound.  Empty steps do
    not count.  (Before, only the engine thread's very first step got it -- empty or not -- so a
    first local prefill after many decodes had 1x.)  Read off the watchdog's deadline inside each
    step: no clock is raced."""
    thread = running(watchdog_s=100.0)
    allowances: list[tuple[int, float]] = []

    def record(step):
        work = thread._work
        allowances.append((step, round((work.deadline - work.began) / thread.watchdog_s, 3)))

    thread.engine.fault_injector = record

    def land(engine):  # a remote prompt whose KV has landed: its first step decodes only
        request = engine.make_request([5, 6, 7, 8], PARAMS, "remote")
        assert engine.scheduler.reserve_remote(request) is not None
        assert engine.scheduler.finish_remote("remote", 9) is not None

    stream = thread.open_stream("remote")
    await thread.call(land)
    while not (item := await asyncio.wait_for(stream.get(), WAIT)).finished:
        pass
    thread.close_stream("remote")
    assert await generate(thread, "local", [5, 6, 7]) and await generate(thread, "again", [9, 10, 11])
    decode_steps = PARAMS["max_tokens"] - 1  # the remote request's first token came with its KV
    assert allowances[0] == (1, FIRST_STEP_ALLOWANCE), allowances  # its first decode
    assert all(a == 1.0 for _, a in allowances[1:decode_steps]), allowances
    assert allowances[decode_steps] == (decode_steps + 1, FIRST_STEP_ALLOWANCE), allowances  # the first prefill
    assert all(a == 1.0 for _, a in allowances[decode_steps + 1:]), allowances


async def test_a_busy_loop_asks_has_work_once_a_step(running):
    """``has_work`` walks the waiting queue (prefix lookups included): the engine thread asks it
    once per loop, and again only when a command or a lease changed something (before: three
    times a step)."""
    thread = running()
    calls = []
    has_work = thread.engine.has_work
    thread.engine.has_work = lambda: calls.append(1) or has_work()
    stream = thread.open_stream("a")

    def add_and_start_counting(engine):
        # in the engine thread, between two steps: no step can run between the reset and the snapshot
        engine.add_request([5, 6, 7], {**PARAMS, "max_tokens": 12}, "a")
        calls.clear()  # from here on no command is sent until the request ends
        return thread.steps

    steps = await thread.call(add_and_start_counting)
    while not (item := await asyncio.wait_for(stream.get(), WAIT)).finished:
        pass
    steps = thread.steps - steps
    assert steps >= 11 and len(calls) <= steps + 2, f"{len(calls)} calls of has_work in {steps} steps"


async def test_each_step_takes_a_core_turn(running, tmp_path):
    """With core turns, a step runs inside a turn: another worker's probe of the lock finds it held
    while the step runs and free once the engine is idle; a step waits while another holds it."""
    turns = CoreTurns(tmp_path / "turns.lock")
    thread = running(core_turns=turns)
    probe = os.open(tmp_path / "turns.lock", os.O_RDWR)
    hold = Hold()
    thread.engine.fault_injector = lambda step: hold() if step == 1 else None
    try:
        request = asyncio.ensure_future(generate(thread, "a", [5, 6, 7]))
        await hold.wait_entered()
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        hold.released.set()
        await asyncio.wait_for(request, WAIT)
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # idle: free; now this "worker" holds it
        second = asyncio.ensure_future(generate(thread, "b", [5, 6, 7]))
        await asyncio.sleep(0.2)  # time for b's 4 steps (a few ms), had its first not waited for the turn
        assert not second.done() and turns.turns == 4  # a's prompt step and 3 decode steps
        fcntl.flock(probe, fcntl.LOCK_UN)
        assert len(await asyncio.wait_for(second, WAIT)) == PARAMS["max_tokens"]
        assert turns.missed == 0
    finally:
        hold.released.set()
        os.close(probe)
