"""Which decode workers a request passes over, and for how long (``Dispatcher.generate``): one that
said "busy" or refused it is skipped while the request tries the others -- not for the rest of its
life.  Decode workers on real sockets (tests/support/dispatch_stubs.py)."""
from __future__ import annotations

import contextlib

from aiohttp import web

from common.cluster.messages import FRAMES_CONTENT_TYPE, GenerateRequest, TokenFrame, decode, frame
from common.engine.sampling_params import SamplingParams
from gateway.dispatch import DispatchResult
from tests.support.dispatch_stubs import dispatcher


def error(kind: str) -> web.Response:
    return web.Response(status=503, body=frame(TokenFrame(error=kind, error_kind=kind)),
                        content_type=FRAMES_CONTENT_TYPE)


async def stream(request, body: GenerateRequest, until: int) -> web.StreamResponse:
    """Tokens 100 + i from where the body resumes, up to ``until`` (exclusive), the last finishing."""
    response = web.StreamResponse(headers={"Content-Type": FRAMES_CONTENT_TYPE})
    await response.prepare(request)
    for i in range(len(body.resume_token_ids), until):
        last = i == body.sampling_params.max_tokens - 1
        await response.write(frame(TokenFrame(token_ids=[100 + i], finished=last,
                                              finish_reason="length" if last else None)))
    return response


def refusing_first(kind: str, until: int, calls: list[str]):
    """A decode worker (d0) that answers ``kind`` ("busy", "refused") at its first call, then streams
    up to ``until``."""
    async def d0(request):
        calls.append("d0")
        body = decode(await request.read(), GenerateRequest)
        return error(kind) if calls.count("d0") == 1 else await stream(request, body, until)

    return d0


async def run(d, max_tokens: int) -> list[int]:
    tokens = []
    params = SamplingParams(max_tokens=max_tokens)
    async with contextlib.aclosing(d.generate("r1", [1, 2, 3], params, DispatchResult())) as frames:
        async for batch in frames:
            tokens += [t for f in batch for t in f.token_ids]
    return tokens


async def test_a_moved_stream_may_go_to_a_worker_that_was_busy_when_it_started():
    """d0 is busy at the request's first try, d1 takes it and hands it over after 2 tokens: d0 --
    with room by now -- continues it.  It was still skipped as busy, and with nobody else and no room
    in line (a full queue) the stream failed mid-way."""
    calls = []

    async def d1(request):
        calls.append("d1")
        body = decode(await request.read(), GenerateRequest)
        response = await stream(request, body, 2)
        d.pool.draining.add("d1")
        await response.write(frame(TokenFrame(error="draining", error_kind="migrate")))
        return response

    async with dispatcher(refusing_first("busy", 6, calls), d1) as d:
        d.queue.size = 0  # no place in line: what a full queue leaves a request
        assert await run(d, 6) == [100 + i for i in range(6)]
    assert calls == ["d0", "d1", "d0"]


async def test_a_worker_that_refused_the_request_is_tried_again_once_it_waited_in_line():
    """d0 refuses (draining a moment, or changing role), d1 is busy: the request waits in line.
    Woken, it tries d0 again -- back at work -- instead of d1 alone until the queue gives it up."""
    calls = []

    async def d1(request):
        calls.append("d1")
        d.queue.notify_all()  # (a registry refresh: d0 is listed as active)
        return error("busy")

    async with dispatcher(refusing_first("refused", 1, calls), d1) as d:
        assert await run(d, 1) == [100]
    assert calls[:2] == ["d0", "d1"] and calls[-1] == "d0"
