"""A decode worker's answer that is no frame stream is the worker's failure, never the client's: the
gateway retries it on another worker before the first token, and answers 502 when no worker gives
a readable answer -- never a 400.

Real aiohttp servers on real sockets stand in for the workers (this tests the dispatcher above
them): each answers ``/generate`` as a worker's auth middleware (JSON 413), a crashed aiohttp
handler (plain-text 500), a proxy (an HTML 502, or an HTML page with 200), or with bytes that are
no frames; a good one streams frames."""
from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp import web

from common.cluster.messages import FRAMES_CONTENT_TYPE, GenerateRequest, TokenFrame, decode, frame
from common.engine.sampling_params import SamplingParams
from decode_svc.generate import error_answer
from gateway.config import UpstreamTimeouts
from gateway.dispatch import DispatchResult, Dispatcher, UpstreamError, WorkerAnswerError
from gateway.handlers import OpenAIHandlers
from gateway.openai_errors import as_invalid
from gateway.openai_protocol import OpenAIError
from tests.support.dispatch_stubs import dispatcher

HTML = b"<!DOCTYPE html><html><body><h1>502 Bad Gateway</h1></body></html>"


async def json_413(request):  # the worker's auth middleware refusing a body over its limit
    return web.json_response({"error": "request body of 9999999 bytes exceeds the limit of 4194304"}, status=413)


async def crash_500(request):  # aiohttp's own answer to a handler that raised
    raise RuntimeError("handler crashed")


async def proxy_502(request):
    return web.Response(status=502, body=HTML, content_type="text/html")


async def proxy_200(request):  # a captive proxy's page
    return web.Response(status=200, body=HTML, content_type="text/html")


async def garbage_frames(request):  # labelled as frames, but no frame: a header announcing 1 GiB
    return web.Response(status=503, body=b"\x40\x00\x00\x00" + b"x" * 64, content_type=FRAMES_CONTENT_TYPE)


async def frames_unlabelled(request):  # a frame, but not labelled as one: who knows what sent it
    return web.Response(status=503, body=frame(TokenFrame(error="no free KV blocks", error_kind="busy")))


async def not_an_error_frame(request):  # an error status whose frame carries no error
    return web.Response(status=500, body=frame(TokenFrame(token_ids=[7])), content_type=FRAMES_CONTENT_TYPE)


async def stream(request):
    body = decode(await request.read(), GenerateRequest)
    response = web.StreamResponse(headers={"Content-Type": FRAMES_CONTENT_TYPE})
    await response.prepare(request)
    for i in range(body.sampling_params.max_tokens):
        last = i == body.sampling_params.max_tokens - 1
        await response.write(frame(TokenFrame(token_ids=[7], finished=last, finish_reason="length" if last else None)))
    return response


BAD = {"json 413": json_413, "plain-text 500": crash_500, "html 502": proxy_502, "html 200": proxy_200,
       "garbage frames": garbage_frames, "500 without an error frame": not_an_error_frame,
       "frames unlabelled": frames_unlabelled}
WORKER_FAULT = {"plain-text 500", "html 502", "html 200", "garbage frames", "500 without an error frame",
                "frames unlabelled"}


async def generate(d: Dispatcher) -> list[TokenFrame]:
    out = []
    async with contextlib.aclosing(d.generate("r1", [1, 2, 3], SamplingParams(max_tokens=3), DispatchResult())) as run:
        async for batch in run:
            out.extend(batch)
    return out


@pytest.mark.parametrize("kind", list(BAD))
async def test_an_answer_that_is_no_frame_stream_is_retried_on_another_worker(kind):
    async with dispatcher(BAD[kind], stream) as d:
        frames = await generate(d)
        assert [f.token_ids for f in frames] == [[7]] * 3 and frames[-1].finished
        # A broken worker (or its proxy) is benched; one that refused this request only is not.
        assert d.pool.benched == (["d0"] if kind in WORKER_FAULT else [])


@pytest.mark.parametrize("kind", list(BAD))
async def test_when_no_worker_answers_readably_the_client_gets_502_not_400(kind):
    async with dispatcher(BAD[kind], BAD[kind]) as d:
        with pytest.raises(WorkerAnswerError, match="no decode worker gave a readable answer") as info:
            await generate(d)
    assert info.value.status == 502
    with pytest.raises(OpenAIError) as http:
        await OpenAIHandlers._upstream(generate_failing(info.value))
    assert http.value.status == 502 and http.value.code == "upstream_error"


async def generate_failing(exc: UpstreamError):
    raise exc


async def html_401_page(request):  # a proxy's or server's 401 page, larger than any excerpt the gateway reads
    return web.Response(status=401, body=b"<html>" + b"x" * 16384 + b"</html>", content_type="text/html")


async def stalled_401(request):  # a 401 whose body never finishes: headers, a little, then silence
    response = web.StreamResponse(status=401, headers={"Content-Type": "text/plain"})  # chunked
    await response.prepare(request)
    await response.write(b"unauthorized: ")
    await asyncio.Event().wait()  # cancelled when the gateway closes the connection


@pytest.mark.parametrize("refusal", [html_401_page, stalled_401])
async def test_a_401_whatever_its_body_is_refused_credentials_retried_elsewhere(refusal):
    """A worker that refuses the cluster credentials is a cluster failure: benched and the request
    retried on another worker, whether its 401 body is a page larger than the excerpt read or never
    finishes (bounded by the response timeout) -- not a client 400, not a 500 after the timeout."""
    async with dispatcher(refusal, stream, timeouts=UpstreamTimeouts(response=5.0)) as d:
        frames = await generate(d)
        assert [f.token_ids for f in frames] == [[7]] * 3 and frames[-1].finished
        assert d.pool.benched == ["d0"]


async def test_a_worker_error_frame_still_means_what_it_says():
    """A real worker's refusals are frames with an error status: "invalid" is the client's 400."""
    async def invalid(request):
        return web.Response(status=400, body=frame(TokenFrame(error="prompt rejected", error_kind="invalid")),
                            content_type=FRAMES_CONTENT_TYPE)

    async with dispatcher(invalid) as d:
        with pytest.raises(ValueError, match="prompt rejected"):
            await generate(d)


async def test_a_stream_a_worker_ends_with_an_error_it_does_not_name_is_an_upstream_error():
    """finish_reason "error" is no answer: the client gets an error, not a "completed" reply."""
    async def errored(request):
        response = web.StreamResponse(headers={"Content-Type": FRAMES_CONTENT_TYPE})
        await response.prepare(request)
        await response.write(frame(TokenFrame(token_ids=[7])) + frame(TokenFrame(finished=True, finish_reason="error")))
        return response

    async with dispatcher(errored) as d:
        with pytest.raises(UpstreamError, match="ended the request with an error"):
            await generate(d)


async def test_a_grammar_the_worker_could_not_follow_is_the_clients_400_naming_its_field():
    """The decode worker's answer names the field (``error_answer``'s ``param``); the client's 400 names
    it too, with the code a grammar refused at compile gets."""
    async def grammar_failed(request):
        return error_answer("structured_outputs: the grammar could not be followed past output token 3 (lexer "
                            "error)", "invalid", 400, "structured_outputs")

    async with dispatcher(grammar_failed) as d:
        with pytest.raises(ValueError) as info:
            await generate(d)
    error = as_invalid(info.value)
    assert (error.status, error.param, error.code) == (400, "structured_outputs", "invalid_grammar")
    assert error.message.startswith("structured_outputs: the grammar could not be followed")
