"""``gateway.migration`` through the dispatcher, against decode workers on real sockets: a stream
whose worker dies mid-stream, or hands it over with a "migrate" frame, goes on at another worker,
which is sent the prompt and exactly the tokens already passed on (computed there: no prefill
worker) and continues; the client sees every token once.  The limit counts moves; at 0 the old
explicit error comes back, and a worker is told it may hand a stream over only while a move is left.
A stream that falls silent after its worker has left the registry moves on at once (``gateway.upstream_watch``),
not after the idle timeout; one still streaming is left alone."""
from __future__ import annotations

import asyncio
import contextlib

import msgspec
import pytest
from aiohttp import web

from common.cluster.messages import FRAMES_CONTENT_TYPE, GenerateRequest, TokenFrame, decode, frame
from common.cluster.auth import new_instance_id
from common.engine.sampling_params import SamplingParams
from gateway.dispatch import DispatchResult, Saturated, UpstreamError
from gateway.config import UpstreamTimeouts
from gateway.metrics import GatewayMetrics
from gateway.migration import StreamMigration
from tests.support.dispatch_stubs import dispatcher, worker as registry_entry

MAX_TOKENS = 9
PROMPT = [1, 2, 3]


def token(i: int) -> int:
    """The i-th output token of the request, whichever worker produces it."""
    return 100 + i


class Worker:
    """A decode worker that continues after ``resume_token_ids`` and, after ``stop_after`` tokens of
    its own, dies (cuts the connection), hands the stream over or stalls (says nothing more, as a
    stopped process); records what it was sent."""

    def __init__(self, stop_after: int | None = None, how: str = "die", pause: float = 0.0):
        self.stop_after, self.how, self.pause = stop_after, how, pause  # pause: before each token
        self.stalled = asyncio.Event()
        self.bodies: list[GenerateRequest] = []
        self.on_hand_over = lambda: None  # what its registry entry then says (set by the test)

    async def handle(self, request):
        return await self.handle_body(request, decode(await request.read(), GenerateRequest))

    async def handle_body(self, request, body: GenerateRequest):
        self.bodies.append(body)
        response = web.StreamResponse(headers={"Content-Type": FRAMES_CONTENT_TYPE})
        await response.prepare(request)
        start = len(body.resume_token_ids)
        for n, i in enumerate(range(start, body.sampling_params.max_tokens)):
            if n == self.stop_after:
                if self.how == "die":
                    request.transport.close()
                    return response
                if self.how == "stall":
                    self.stalled.set()
                    await asyncio.sleep(3600)  # (cancelled when the gateway closes the stream)
                self.on_hand_over()
                await response.write(frame(TokenFrame(error="draining", error_kind="migrate")))
                return response
            last = i == body.sampling_params.max_tokens - 1
            await asyncio.sleep(self.pause)
            await response.write(frame(TokenFrame(token_ids=[token(i)], finished=last,
                                                  finish_reason="length" if last else None)))
        return response


def registered(d, workers) -> None:
    """Each worker that hands a stream over is draining in the dispatcher's view from then on."""
    for i, worker in enumerate(workers):
        worker.on_hand_over = lambda worker_id=f"d{i}": d.pool.draining.add(worker_id)


async def run(d, result=None) -> list[int]:
    tokens = []
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=3)
    async with contextlib.aclosing(d.generate("r1", PROMPT, params, result or DispatchResult())) as frames:
        async for batch in frames:
            tokens += [t for f in batch for t in f.token_ids]
    return tokens


@pytest.mark.parametrize("how", ["die", "migrate"])
async def test_a_stream_goes_on_at_another_worker_after_the_tokens_passed_on(how):
    first, second = Worker(stop_after=4, how=how), Worker()
    async with dispatcher(first.handle, second.handle) as d:
        registered(d, [first, second])
        aborted = []
        d.abort = lambda url, request_id, audience: asyncio.sleep(0, aborted.append(audience.split("/")[0]))
        assert await run(d) == [token(i) for i in range(MAX_TOKENS)]  # each token once
        # A lost worker is told to stop (it may compute on); one that handed the stream over ended it
        # (an abort could land on the stream come back to it, under the same id).
        assert aborted == (["d0"] if how == "die" else [])
        cause = "worker_lost" if how == "die" else "drain"
        assert d.metrics.migrations.labels(cause)._value.get() == 1
        assert d.metrics.migrated_tokens._value.get() == 4
    assert first.bodies[0].resume_token_ids == [] and first.bodies[0].may_migrate
    moved = second.bodies[0]
    assert moved.prompt_token_ids == PROMPT and moved.resume_token_ids == [token(i) for i in range(4)]
    # A lost worker's stream is computed where it continues; a handed-over one's KV comes from the
    # worker it left, whose cache holds it.
    assert moved.prefill_worker_id == (None if how == "die" else "d0")
    assert moved.sampling_params.seed == 3 and moved.sampling_params.max_tokens == MAX_TOKENS


async def test_two_moves_and_the_limit():
    workers = [Worker(stop_after=2), Worker(stop_after=3, how="migrate"), Worker()]
    async with dispatcher(*(w.handle for w in workers), migration_limit=2) as d:
        registered(d, workers)
        assert await run(d) == [token(i) for i in range(MAX_TOKENS)]
    assert [len(w.bodies[0].resume_token_ids) for w in workers] == [0, 2, 5]
    assert [w.bodies[0].may_migrate for w in workers] == [True, True, False]  # no move left for the last

    workers = [Worker(stop_after=2), Worker(stop_after=3), Worker()]
    async with dispatcher(*(w.handle for w in workers), migration_limit=1) as d:
        with pytest.raises(UpstreamError, match="failed mid-stream"):
            await run(d)
    assert not workers[2].bodies


async def test_a_move_that_no_worker_continues_is_not_counted():
    """The stream's worker dies after 2 tokens and the worker it moves to dies before a token of its
    own: no worker is left, the stream ends with an error once its wait for one is over, and no
    migration (nor a replayed token) is counted -- they counted the move as it set out."""
    workers = [Worker(stop_after=2), Worker(stop_after=0)]
    async with dispatcher(*(w.handle for w in workers)) as d:
        d.queue.timeout_s = 0.5  # (the wait for a worker that does not come)
        with pytest.raises(Saturated):
            await run(d)
        assert d.metrics.migrations.labels("worker_lost")._value.get() == 0
        assert d.metrics.migrated_tokens._value.get() == 0
    assert workers[1].bodies[0].resume_token_ids == [token(0), token(1)]  # (it was sent the stream)


async def test_without_migration_a_lost_worker_ends_the_stream_with_an_error():
    first, second = Worker(stop_after=4), Worker()
    async with dispatcher(first.handle, second.handle, migration_limit=0) as d:
        with pytest.raises(UpstreamError, match="failed mid-stream"):
            await run(d)
    assert not first.bodies[0].may_migrate and not second.bodies


async def test_a_stream_whose_new_worker_dies_goes_back_to_the_draining_worker_it_left():
    """d0 drains and hands the stream to d1, which dies: no active decode worker is left, so d0 --
    draining, alive, its cache holding the stream -- continues it to its end (it waited in line
    for one and failed the stream)."""
    d0_calls = []

    async def d0(request):  # hands the stream over once (its drain), then decodes what it is sent to the end
        d0_calls.append(decode(await request.read(), GenerateRequest))
        handing_over = Worker(stop_after=2, how="migrate") if len(d0_calls) == 1 else Worker()
        handing_over.on_hand_over = lambda: d.pool.draining.add("d0")
        return await handing_over.handle_body(request, d0_calls[-1])

    second = Worker(stop_after=3)
    async with dispatcher(d0, second.handle) as d:
        assert await run(d) == [token(i) for i in range(MAX_TOKENS)]  # each token once
        assert d.metrics.migrations.labels("drain")._value.get() == 1
        assert d.metrics.migrations.labels("worker_lost")._value.get() == 1
    assert [len(b.resume_token_ids) for b in d0_calls] == [0, 5] and d0_calls[1].prefill_worker_id is None
    assert [b.last_resort for b in d0_calls] == [False, True] and not second.bodies[0].last_resort
    assert [b.may_migrate for b in d0_calls] == [True, False]  # (it drains: never handed over again)
    assert len(second.bodies[0].resume_token_ids) == 2


def test_the_last_resort_is_a_draining_decode_worker_the_one_the_stream_left_first():
    def entry(worker_id, state, role="decode"):
        return msgspec.structs.replace(registry_entry(worker_id, role), state=state)

    migration = StreamMigration(3, GatewayMetrics())
    assert migration.last_resort([entry("d0", "active"), entry("p0", "draining", "prefill")]) is None
    assert migration.last_resort([entry("d0", "idle"), entry("d1", "draining")]).worker_id == "d0"  # (the first)
    migration.move("drain", kv_source=entry("d1", "draining"))
    migration.move("worker_lost")
    assert migration.last_resort([entry("d0", "idle"), entry("d1", "draining")]).worker_id == "d1"


async def test_a_worker_that_refused_the_moved_stream_takes_it_back_once_it_serves_again():
    """d0 hands the stream over before its registry entry says it drains, so the gateway tries it
    again and is refused (a stale view).  Put back to work, it must still be a candidate when d1
    hands the stream over in turn: a refusal excludes a worker only until the stream moves again."""
    d0_calls = []

    async def d0(request):
        d0_calls.append(decode(await request.read(), GenerateRequest))
        if len(d0_calls) == 2:  # the stale route back: refused, and now its entry says it drains
            d.pool.draining.add("d0")
            return web.Response(body=frame(TokenFrame(error="worker is draining", error_kind="refused")),
                                status=503, content_type=FRAMES_CONTENT_TYPE)
        return await Worker(stop_after=2 if len(d0_calls) == 1 else None, how="migrate").handle_body(
            request, d0_calls[-1])

    d1 = Worker(stop_after=3, how="migrate")
    d1.on_hand_over = lambda: d.pool.draining.discard("d0")  # d0 serves again; d1 drains
    async with dispatcher(d0, d1.handle, migration_limit=2) as d:
        assert await run(d) == [token(i) for i in range(MAX_TOKENS)]
    assert [len(body.resume_token_ids) for body in d0_calls] == [0, 2, 5]
    assert len(d1.bodies[0].resume_token_ids) == 2


async def test_a_silent_stream_of_a_worker_gone_from_the_registry_moves_on_without_the_idle_timeout():
    """d0 stalls after 4 tokens (stopped: its heartbeats stop too).  While its entry is listed its
    silent stream is waited for; once the entry has expired, at the next read of the registry, the
    stream is cut and goes on at d1 -- not after the 60 s idle timeout."""
    first, second = Worker(stop_after=4, how="stall"), Worker()
    async with dispatcher(first.handle, second.handle) as d:
        d.left_watch.silence_s = 0.0
        tokens = asyncio.create_task(run(d))
        await asyncio.wait_for(first.stalled.wait(), 60)
        for listener in d.pool.listeners:  # a refresh of the registry: d0 still listed
            listener(d.pool.workers, d.pool.workers)
        await asyncio.sleep(0.05)
        assert not tokens.done() and len(d.left_watch) == 1
        for listener in d.pool.listeners:  # the next: d0 is gone
            listener(d.pool.workers, [w for w in d.pool.workers if w.worker_id != "d0"])
        assert await asyncio.wait_for(tokens, 30) == [token(i) for i in range(MAX_TOKENS)]  # each token once
        assert d.metrics.upstream_timeouts.labels("left")._value.get() == 1
        assert d.metrics.upstream_timeouts.labels("idle")._value.get() == 0
        assert d.metrics.migrations.labels("worker_lost")._value.get() == 1
        assert len(d.left_watch) == 0  # every stream read is forgotten once done with
    resumed = second.bodies[0].resume_token_ids  # what reached the gateway before the cut
    assert len(resumed) <= 4 and resumed == [token(i) for i in range(len(resumed))]


async def test_a_stream_still_coming_from_a_worker_gone_from_the_registry_is_not_cut():
    """Its heartbeats fail (Redis lost, say) but its frames keep coming, the stream lasting far past the
    silence that cuts: every refresh that finds it gone sees a stream heard from just now, and leaves it."""
    worker = Worker(pause=0.05)  # 9 tokens: ~0.45 s
    async with dispatcher(worker.handle) as d:
        d.left_watch.silence_s = 0.1
        tokens = []
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=3)
        async with contextlib.aclosing(d.generate("r1", PROMPT, params, DispatchResult())) as frames:
            async for batch in frames:
                for listener in d.pool.listeners:
                    listener(d.pool.workers, [])
                tokens += [t for f in batch for t in f.token_ids]
        assert tokens == [token(i) for i in range(MAX_TOKENS)]
        assert d.metrics.upstream_timeouts.labels("left")._value.get() == 0 and len(d.left_watch) == 0
    assert len(worker.bodies) == 1


async def test_a_stream_whose_frames_wait_for_a_slow_client_is_not_cut_when_its_worker_leaves_the_registry():
    """The dispatcher passes a batch on to a client that takes its time; meanwhile a read of the
    registry misses the worker (a late heartbeat).  Its frames were arriving all along -- the
    dispatcher was not waiting for them -- so the stream is not silent: it was cut (and moved, its
    worker benched) as if the worker had stopped."""
    first, second = Worker(), Worker()
    async with dispatcher(first.handle, second.handle) as d:
        d.left_watch.silence_s = 0.05
        tokens = []
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=3)
        async with contextlib.aclosing(d.generate("r1", PROMPT, params, DispatchResult())) as frames:
            async for batch in frames:
                if not tokens:  # the slow client, at its first batch
                    await asyncio.sleep(0.1)
                    for listener in d.pool.listeners:
                        listener(d.pool.workers, [w for w in d.pool.workers if w.worker_id != "d0"])
                tokens += [t for f in batch for t in f.token_ids]
        assert tokens == [token(i) for i in range(MAX_TOKENS)]
        assert d.metrics.upstream_timeouts.labels("left")._value.get() == 0 and not d.pool.benched
    assert not second.bodies


async def test_a_move_announced_before_the_first_token_leaves_the_prompt_its_first_token_timeout():
    """A worker computing a prompt itself starts to drain: it says the stream will move soon, then
    (no other worker to take it) goes on computing.  That frame is no first token: the prompt keeps
    the first token's bound, not the shorter bound between tokens, which cut it and benched the worker."""
    computing = asyncio.Event()

    async def d0(request):
        body = decode(await request.read(), GenerateRequest)
        response = web.StreamResponse(headers={"Content-Type": FRAMES_CONTENT_TYPE})
        await response.prepare(request)
        await response.write(frame(TokenFrame(move_soon=True)))
        await computing.wait()  # the rest of the prompt: longer than the idle bound
        return await _stream_rest(response, body)

    async with dispatcher(d0, timeouts=UpstreamTimeouts(idle=0.2, first_token=120.0)) as d:
        d._precopy = lambda *args: asyncio.sleep(0)  # (no other worker to copy to)
        loop = asyncio.get_running_loop()
        loop.call_later(0.6, computing.set)
        assert await run(d) == [token(i) for i in range(MAX_TOKENS)]
        assert not d.pool.benched and d.metrics.upstream_timeouts.labels("idle")._value.get() == 0


async def _stream_rest(response, body: GenerateRequest):
    for i in range(body.sampling_params.max_tokens):
        last = i == body.sampling_params.max_tokens - 1
        await response.write(frame(TokenFrame(token_ids=[token(i)], finished=last, finish_reason="length" if last else None)))
    return response


@pytest.mark.parametrize("back_as", ["the same run", "a new run"])
async def test_a_stream_whose_only_decode_worker_failed_goes_on_there_once_it_is_back(back_as):
    """d0, the only decode worker, loses the stream after 4 tokens (stopped past its registry entry's
    life, or killed and restarted) and is back: the stream goes on there.  It waited in line for a
    worker other than d0's failed run -- for ever, while d0 sat idle -- until the queue gave it up,
    and every request in line behind it waited with it."""
    calls = []

    async def d0(request):
        calls.append(decode(await request.read(), GenerateRequest))
        return await Worker(stop_after=4 if len(calls) == 1 else None).handle_body(request, calls[-1])

    async with dispatcher(d0) as d:
        def back(worker_id):  # (its bench, a few seconds in the real pool, is over)
            if back_as == "a new run":
                d.pool.workers = [msgspec.structs.replace(w, instance=new_instance_id()) for w in d.pool.workers]

        d.pool.bench = back
        assert await run(d) == [token(i) for i in range(MAX_TOKENS)]
    assert [len(body.resume_token_ids) for body in calls] == [0, 4]
