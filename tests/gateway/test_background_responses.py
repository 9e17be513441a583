"""Background responses over a real Redis (gateway/background_responses.py, the run marks of
gateway/response_store.py), with a generation the test holds: the shell is stored ``queued`` before
anything runs, then reads ``in_progress``; its end replaces it; a cancel wins over an end that comes
after it, stops the generation and frees the admission, and cancelling twice is cancelling once; a
deleted response stops its run and is not stored again; a run whose mark is lost or whose gateway
stops reads ``failed``; a shell that cannot be stored is a 503 and runs nothing; only a background
response can be cancelled, and one that has not answered cannot be continued."""
from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from gateway.background_responses import BackgroundResponses
from gateway.openai_errors import OpenAIError
from gateway.openai_protocol import ChatMessage
from gateway.response_runs import RunStore
from gateway.response_store import LOST, ResponseStore, StoredResponse

INPUT = [ChatMessage(role="user", content="hi")]
ANSWER = ChatMessage(role="assistant", content="hello")


def rid(n: int) -> str:
    return f"resp_{n:032x}"


def response(n: int, status: str, background: bool = True) -> bytes:
    return json.dumps({"id": rid(n), "status": status, "background": background, "output": []}).encode()


def shell(n: int) -> StoredResponse:
    return StoredResponse(response(n, "queued"), list(INPUT), 1, answered=False, running=True)


def finished(n: int) -> StoredResponse:
    return StoredResponse(response(n, "completed"), [*INPUT, ANSWER], 1)


class Held:
    """A generation the test releases, and the admission a run holds."""

    def __init__(self):
        self.release, self.started, self.stopped = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.admitted = contextlib.AsyncExitStack()
        self.admitted.callback(self.stopped.set)  # the run let its admission go

    def generate(self, store: ResponseStore, n: int):
        async def run(generating) -> None:
            generating()  # its first token
            self.started.set()
            await self.release.wait()
            await RunStore(store).finish("key-a", rid(n), finished(n))
        return run


@pytest.fixture
def store(redis_client, key_prefix):
    return ResponseStore(redis_client, key_prefix=key_prefix, max_bytes=1 << 20, timeout_s=5.0)


@pytest.fixture
async def runs(store):
    background = BackgroundResponses(store, max_runs=8, heartbeat_s=0.02, lease_s=30)
    yield background
    await background.close()


@pytest.fixture
async def slow_runs(store):
    """Runs whose next heartbeat is far off: what stops one now is the gateway it runs in."""
    background = BackgroundResponses(store, max_runs=8, heartbeat_s=3600, lease_s=7200)
    yield background
    await background.close()


async def settled(awaitable) -> None:
    """Wait for ``awaitable`` (a hang guard, generous: the tests wait for events, not for time)."""
    async with asyncio.timeout(120):
        await awaitable


async def status(store: ResponseStore, n: int) -> str:
    return json.loads((await store.load("key-a", rid(n))).response)["status"]


async def until(condition) -> None:
    async with asyncio.timeout(120):
        while not await condition():
            await asyncio.sleep(0.01)


async def start(runs: BackgroundResponses, store: ResponseStore, n: int) -> Held:
    held = Held()
    await runs.start("key-a", rid(n), shell(n), held.generate(store, n), held.admitted)
    return held


async def test_a_run_is_stored_queued_then_in_progress_then_its_end(runs, store):
    held = Held()
    generate = held.generate(store, 1)

    async def checked(generating) -> None:  # the shell is there before the generation starts
        assert await status(store, 1) == "queued"
        await generate(generating)

    await runs.start("key-a", rid(1), shell(1), checked, held.admitted)
    await settled(held.started.wait())
    await until(lambda: _is(store, 1, "in_progress"))
    with pytest.raises(OpenAIError) as info:
        await store.load("key-a", rid(1), param="previous_response_id")  # no output yet
    assert (info.value.status, info.value.code) == (400, "response_not_continuable")
    held.release.set()
    await settled(held.stopped.wait())
    loaded = await store.load("key-a", rid(1), param="previous_response_id")
    assert (json.loads(loaded.response)["status"], loaded.messages, loaded.running) == (
        "completed", [*INPUT, ANSWER], False)
    assert loaded.input_messages == INPUT
    assert runs.running == 0


async def test_a_cancel_stops_the_run_frees_its_admission_and_wins_over_its_end(slow_runs, store):
    runs = slow_runs  # (stopped by the cancel here, not by a heartbeat)
    held = await start(runs, store, 2)
    await settled(held.started.wait())
    cancelled = json.loads(await runs.cancel("key-a", rid(2)))
    assert cancelled["status"] == "cancelled"
    await settled(held.stopped.wait())  # the generation stopped, the admission went with it
    assert not await RunStore(store).finish("key-a", rid(2), finished(2))  # an end after the cancel is not stored
    assert await status(store, 2) == "cancelled"
    assert json.loads(await runs.cancel("key-a", rid(2)))["status"] == "cancelled"  # twice: as once
    stored = await store.load("key-a", rid(2))
    assert (stored.running, stored.answered, stored.input_messages) == (False, False, INPUT)


async def test_a_cancel_from_another_gateway_stops_the_run_at_its_heartbeat(runs, store, redis_client, key_prefix):
    held = await start(runs, store, 3)
    await settled(held.started.wait())
    elsewhere = BackgroundResponses(ResponseStore(redis_client, key_prefix=key_prefix, max_bytes=1 << 20,
                                                  timeout_s=5.0), max_runs=8)
    assert json.loads(await elsewhere.cancel("key-a", rid(3)))["status"] == "cancelled"
    await settled(held.stopped.wait())
    assert await status(store, 3) == "cancelled"


async def test_a_deleted_run_stops_and_is_not_stored_again(runs, slow_runs, store):
    held = await start(runs, store, 4)
    await settled(held.started.wait())
    await store.delete("key-a", rid(4))  # (on another gateway: this one learns it at its heartbeat)
    await settled(held.stopped.wait())
    here = await start(slow_runs, store, 10)
    await settled(here.started.wait())
    await store.delete("key-a", rid(10))
    slow_runs.forget("key-a", rid(10))  # (the DELETE route, on the gateway it runs in: at once)
    await settled(here.stopped.wait())
    assert not await RunStore(store).finish("key-a", rid(4), finished(4))
    with pytest.raises(OpenAIError) as info:
        await store.load("key-a", rid(4))
    assert info.value.status == 404


async def test_a_run_whose_mark_is_lost_reads_failed_and_stops(runs, store, redis_client, key_prefix):
    held = await start(runs, store, 5)
    await settled(held.started.wait())
    await redis_client.delete(f"{key_prefix}:responses:key-a:{rid(5)}:run")  # as a lapsed lease leaves it
    loaded = json.loads((await store.load("key-a", rid(5))).response)
    assert (loaded["status"], loaded["error"]) == ("failed", {"code": "server_error", "message": LOST})
    await settled(held.stopped.wait())
    assert not await RunStore(store).finish("key-a", rid(5), finished(5))


async def test_a_stopping_gateway_gives_its_runs_up(runs, store):
    held = await start(runs, store, 6)
    await settled(held.started.wait())
    await runs.close()
    assert held.stopped.is_set()
    assert await status(store, 6) == "failed"


async def test_a_shell_that_cannot_be_stored_is_a_503_and_runs_nothing(store):
    runs = BackgroundResponses(ResponseStore(store.redis, key_prefix="unused", max_bytes=64, timeout_s=5.0), max_runs=8)
    held = Held()
    with pytest.raises(OpenAIError) as info:
        await runs.start("key-a", rid(7), shell(7), held.generate(store, 7), held.admitted)
    assert info.value.status == 503
    assert held.stopped.is_set() and not held.started.is_set() and runs.running == 0


async def test_only_a_background_response_is_cancelled_and_an_ended_one_stays_as_it_ended(runs, store):
    await store.save("key-a", rid(8), StoredResponse(response(8, "completed", background=False), [*INPUT, ANSWER], 1))
    with pytest.raises(OpenAIError) as info:
        await runs.cancel("key-a", rid(8))
    assert (info.value.status, info.value.param) == (400, "response_id")
    held = await start(runs, store, 9)
    held.release.set()
    await settled(held.stopped.wait())
    assert json.loads(await runs.cancel("key-a", rid(9)))["status"] == "completed"
    with pytest.raises(OpenAIError) as info:
        await runs.cancel("key-b", rid(9))  # another API key's
    assert info.value.status == 404


async def _is(store: ResponseStore, n: int, expected: str) -> bool:
    return await status(store, n) == expected


async def test_a_gateway_runs_at_most_its_bound_of_background_responses(store):
    runs = BackgroundResponses(store, max_runs=1)
    try:
        held = await start(runs, store, 11)
        over = Held()
        with pytest.raises(OpenAIError) as info:
            await runs.start("key-a", rid(12), shell(12), over.generate(store, 12), over.admitted)
        assert (info.value.status, info.value.code) == (429, "rate_limit_exceeded")
        assert over.stopped.is_set() and not over.started.is_set()  # its admission let go, nothing ran
        held.release.set()
        await settled(held.stopped.wait())
    finally:
        await runs.close()


async def test_an_ended_run_leaves_nothing_held_by_its_gateway(slow_runs, store):
    held = Held()

    async def streaming(generating) -> None:
        await slow_runs.runs.append("key-a", rid(13), [b"event: response.created\ndata: {}\n\n"])
        held.started.set()
        await held.release.wait()

    await slow_runs.start("key-a", rid(13), shell(13), streaming, held.admitted)
    await settled(held.started.wait())
    assert slow_runs.runs.held == 1
    await slow_runs.cancel("key-a", rid(13))
    await settled(held.stopped.wait())
    while slow_runs.running:  # (the run's last step follows its admission's)
        await asyncio.sleep(0.01)
    assert slow_runs.runs.held == 0


async def test_a_run_says_in_progress_at_its_first_token(slow_runs, store):
    held = await start(slow_runs, store, 14)
    await settled(held.started.wait())
    await until(lambda: _is(store, 14, "in_progress"))  # at once, not at its next heartbeat (an hour off)
    held.release.set()
    await settled(held.stopped.wait())


async def test_runs_started_at_once_count_against_the_bound_while_their_shells_are_stored(store):
    runs = BackgroundResponses(store, max_runs=1)
    try:
        first, second = Held(), Held()
        started = await asyncio.gather(
            runs.start("key-a", rid(15), shell(15), first.generate(store, 15), first.admitted),
            runs.start("key-a", rid(16), shell(16), second.generate(store, 16), second.admitted),
            return_exceptions=True)
        refused = [r for r in started if isinstance(r, OpenAIError)]
        assert [r.status for r in refused] == [429]
    finally:
        first.release.set(), second.release.set()
        await runs.close()
