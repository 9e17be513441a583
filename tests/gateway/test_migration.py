"""``gateway.migration`` through the dispatcher, against decode workers on real sockets: a stream
whose worker dies mid-stream, or hands it over with a "migrate" frame, goes on at another worker,
which is sent the prompt and exactly the tokens already passed on (computed there: no prefill
worker) and continues; the client sees every token once.  The limit counts moves; at 0 the old
explicit error comes back, and a worker is told it may hand a stream over only while a move is left."""
from __future__ import annotations

import contextlib

import pytest
from aiohttp import web

from common.cluster.messages import FRAMES_CONTENT_TYPE, GenerateRequest, TokenFrame, decode, frame
from common.engine.sampling_params import SamplingParams
from gateway.dispatch import DispatchResult, UpstreamError
from tests.support.dispatch_stubs import dispatcher

MAX_TOKENS = 9
PROMPT = [1, 2, 3]


def token(i: int) -> int:
    """The i-th output token of the request, whichever worker produces it."""
    return 100 + i


class Worker:
    """A decode worker that continues after ``resume_token_ids`` and, after ``stop_after`` tokens of
    its own, dies (cuts the connection) or hands the stream over; records what it was sent."""

    def __init__(self, stop_after: int | None = None, how: str = "die"):
        self.stop_after, self.how = stop_after, how
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
                self.on_hand_over()
                await response.write(frame(TokenFrame(error="draining", error_kind="migrate")))
                return response
            last = i == body.sampling_params.max_tokens - 1
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
        assert await run(d) == [token(i) for i in range(MAX_TOKENS)]  # each token once
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


async def test_without_migration_a_lost_worker_ends_the_stream_with_an_error():
    first, second = Worker(stop_after=4), Worker()
    async with dispatcher(first.handle, second.handle, migration_limit=0) as d:
        with pytest.raises(UpstreamError, match="failed mid-stream"):
            await run(d)
    assert not first.bodies[0].may_migrate and not second.bodies


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
