"""The gateway against decode workers that misbehave: hung, stalled, busy, flooding; and clients that
misbehave: slow readers, greedy keys, too many connections.

A real gateway process (real Redis, real sockets) routes to fake decode workers (tests/support/fake_decode.py)
registered in the registry like real ones; each test registers its own, with its own ids.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import gzip
import json
import socket
import threading
import urllib.error
import urllib.request
import uuid

import aiohttp
import openai
import pytest
from aiohttp import web

from launcher.local_stack import gateway_health
from common.cluster.messages import FRAMES_CONTENT_TYPE, GenerateRequest, TokenFrame, decode, frame
from tests.support.cluster import http_json, running_cluster
from tests.support.fake_decode import FakeDecodeWorker
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow(seconds=56)  # a long file: scheduled by its length (tests/conftest.py)

GATEWAY_ARGS = [
    "--upstream-response-timeout", "10", "--first-token-timeout", "20", "--upstream-idle-timeout", "5",
    "--bench-time", "600", "--max-inflight", "200", "--queue-size", "2", "--queue-timeout", "12",
    # The bounds on one decode worker's answer, seen alone: a stream that stalls after its first
    # token ends with the idle timeout's error instead of moving on (the fakes cannot continue a
    # moved stream; tests/gateway/test_migration.py and tests/serving/test_serving_faults.py move them).
    "--migration-limit", "0",
]


@pytest.fixture(scope="module")
def stack(served_checkpoint, redis_url, tmp_path_factory):
    with running_cluster(served_checkpoint, tmp_path_factory.mktemp("logs"), redis_url, prefill=0, decode=0,
                         gateway_args=GATEWAY_ARGS) as c:
        yield c


@pytest.fixture
def fakes(stack):
    """``fakes(behaviour, ...)`` starts a fake decode worker; the gateway sees all of them on return."""
    started: list[FakeDecodeWorker] = []

    def start(*behaviours: str, **kw) -> list[FakeDecodeWorker]:
        tag = uuid.uuid4().hex[:6]
        for i, behaviour in enumerate(behaviours):
            # Ids sort in start order: with equal loads the router picks the first.
            worker = FakeDecodeWorker(stack.redis_url, stack.key_prefix, stack.model_name, f"{tag}-{i}-{behaviour}",
                                      behaviour, cluster_secret=stack.cluster_secret, **kw)
            started.append(worker.start())
        stack.wait_for_workers(0, len(started))
        return started[-len(behaviours):]

    yield start
    for worker in started:
        worker.stop()
    stack.wait_for_workers(0, 0)


def client(stack, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none", max_retries=0, timeout=60, **kw)


def sse_events(stack, body: dict) -> list[str]:
    """POST a streaming completion; return the data of every SSE event (the status must be 200)."""

    async def main():
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{stack.gateway_url}/v1/completions",
                                    json={"model": stack.model_name, "stream": True, **body}) as resp:
                assert resp.status == 200
                text = (await resp.read()).decode()
        return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]

    return asyncio.run(main())


def complete(stack, max_tokens: int = 4, **kw):
    return client(stack).completions.create(model=stack.model_name, prompt="Hello world", max_tokens=max_tokens,
                                            **kw)


# ---- timeouts (item 5 of issue 8) --------------------------------------------------------------


def test_hung_decode_worker_is_benched_and_the_request_retried(stack, fakes):
    hung, healthy = fakes("hang", "stream")
    response = complete(stack)
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 4
    assert len(hung.generate_calls) == 1 and len(healthy.generate_calls) == 1
    hung.wait_for(lambda: hung.open_streams == 0, what="the gateway to drop the hung call")
    # Benched: the next requests go straight to the healthy worker, and /health says so.
    for _ in range(3):
        complete(stack)
    assert len(hung.generate_calls) == 1 and len(healthy.generate_calls) == 4
    assert gateway_health(stack.gateway_url)["pools"]["decode"] == {"healthy": 1, "benched": 1}


def test_worker_that_stops_mid_stream_ends_the_stream_with_an_error(stack, fakes):
    first, second = fakes("stall", "stall")  # the first is benched after its timeout
    stream = client(stack).completions.create(model=stack.model_name, prompt="Hello world", max_tokens=50,
                                              stream=True)
    chunks = iter(stream)
    assert next(chunks).choices[0].text
    with pytest.raises(openai.APIError, match="sent nothing more"):
        for _ in chunks:
            pass
    # On the wire: the error event, then [DONE].
    events = sse_events(stack, {"prompt": "Hello world", "max_tokens": 50})
    assert events[-1] == "[DONE]" and "sent nothing more" in events[-2]
    for worker in (first, second):
        worker.wait_for(lambda: len(worker.aborts) == 1, what="the abort")
        assert worker.aborts == worker.generate_calls


STREAMS_OPEN_BOUND_S = 300.0


def test_more_concurrent_streams_than_aiohttps_default_pool(stack, fakes):
    # aiohttp's default connector holds 100 connections; the gateway admits 200 requests, so
    # stream 101 would wait silently for a connection if the pool were not sized to max_inflight.
    (slow,) = fakes("trickle", trickle_s=0.5)  # 1000 tokens: outlasts the test
    n = 120

    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            bodies = [{"model": stack.model_name, "prompt": f"Hello {i}", "max_tokens": 1000, "stream": True}
                      for i in range(n)]
            responses = await asyncio.gather(*(session.post(f"{stack.gateway_url}/v1/completions", json=body)
                                               for body in bodies))
            try:
                assert all(r.status == 200 for r in responses)
                # Every stream is open on the worker at the same time: none is queued behind another
                # (the bound only ends a test that fails: with a pool of 100 the rest never start).
                await asyncio.to_thread(slow.wait_for, lambda: slow.peak_streams == n, STREAMS_OPEN_BOUND_S,
                                        f"{n} streams open at once")
                await asyncio.wait_for(asyncio.gather(*(r.content.readline() for r in responses)),
                                       STREAMS_OPEN_BOUND_S)
            finally:
                for r in responses:
                    r.close()

    asyncio.run(main())
    # Each disconnect sends an abort on the control pool, none lost.
    slow.wait_for(lambda: len(slow.aborts) == n, what=f"{n} aborts")
    assert sorted(slow.aborts) == sorted(slow.generate_calls)


# ---- backpressure (item 6 of issue 8) ----------------------------------------------------------


def test_a_busy_decode_worker_passes_the_request_to_another(stack, fakes):
    busy, free = fakes("busy", "stream")
    response = complete(stack)
    assert response.choices[0].finish_reason == "length"
    assert len(busy.generate_calls) == 1 and len(free.generate_calls) == 1
    assert busy.aborts == []  # nothing started there, nothing to abort


def test_when_every_decode_worker_is_busy_the_request_waits_for_room(stack, fakes):
    (worker,) = fakes("busy")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(complete, stack)
        worker.wait_for(lambda: len(worker.generate_calls) >= 1, what="the first (busy) attempt")
        assert not pending.done()
        worker.behaviour = "stream"  # room appears: the held request is served
        response = pending.result(timeout=60)
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 4
    assert len(worker.generate_calls) >= 2 and set(worker.generate_calls) == {response.id}


class HoldingBusyWorker(FakeDecodeWorker):
    """Answers busy (or as ``behaviour`` says), except that its ``hold_call``-th call for the
    prompt ending in ``hold_tag`` waits for ``release()`` (``holding`` is set meanwhile), then
    answers busy."""

    def __init__(self, *args, hold_tag: int, hold_call: int, **kw):
        super().__init__(*args, **kw)
        self.hold_tag, self.hold_call = hold_tag, hold_call
        self.calls_by_tag: collections.Counter[int] = collections.Counter()
        self.holding = threading.Event()
        self._released: asyncio.Event | None = None

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._released.set)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        tag = decode(await request.read(), GenerateRequest).prompt_token_ids[-1]
        self.calls_by_tag[tag] += 1
        if tag == self.hold_tag and self.calls_by_tag[tag] == self.hold_call:
            self._released = asyncio.Event()
            self.holding.set()
            await self._released.wait()
            return web.Response(status=503, body=frame(TokenFrame(error="no free KV blocks", error_kind="busy")),
                                content_type=FRAMES_CONTENT_TYPE)
        return await super()._generate(request)


def test_the_wait_queue_is_bounded_and_first_come_first_served(stack):
    """Queue size 2.  A waits, then B.  A is woken (a registry refresh) and tries again; its
    answer is held while C arrives: the line is full -- A still holds its place -- so C gets 503
    + Retry-After at once, without overtaking anyone.  A's answer is busy: it waits again, first in
    line, and when room appears A and B are served."""
    a, b, c = 21, 22, 23  # the last prompt token tells the worker which request it is
    worker = HoldingBusyWorker(stack.redis_url, stack.key_prefix, stack.model_name, f"{uuid.uuid4().hex[:6]}-held",
                               "busy", cluster_secret=stack.cluster_secret, hold_tag=a, hold_call=2)

    def attempt(tag):
        try:
            client(stack).completions.create(model=stack.model_name, prompt=[11, 12, 13, tag], max_tokens=4)
        except openai.APIStatusError as exc:
            return exc.status_code, exc.response.headers.get("retry-after"), exc.message
        return 200, None, ""

    with worker, concurrent.futures.ThreadPoolExecutor(3) as pool:
        stack.wait_for_workers(0, 1)
        first = pool.submit(attempt, a)
        wait_until(lambda: worker.holding.is_set() or metric(stack.gateway_url, "pdserve_requests_queued") == 1,
                   "A in line")
        second = pool.submit(attempt, b)
        wait_until(lambda: metric(stack.gateway_url, "pdserve_requests_queued") == 2 or worker.calls_by_tag[b],
                   "B in line")
        assert worker.holding.wait(30), "A was never woken to try again"
        third = pool.submit(attempt, c)  # while A's second try is on its way
        wait_until(lambda: third.done() or worker.calls_by_tag[c], "C refused, or trying")
        worker.behaviour = "stream"  # room, from now on; A's held answer is still busy
        worker.release()
        assert first.result(timeout=60) == (200, None, "")  # waited longest: served, not refused
        assert second.result(timeout=60) == (200, None, "")
        status, retry_after, message = third.result(timeout=60)
        assert status == 503 and retry_after and "2 requests are already waiting" in message, message
        assert worker.calls_by_tag[c] == 0  # it did not try ahead of those in line
    stack.wait_for_workers(0, 0)


def test_a_burst_spreads_over_decode_workers(stack, fakes):
    # Both report the same load at their last heartbeat; counting what it just sent each one, the
    # gateway alternates instead of sending the whole burst to the first.
    a, b = fakes("trickle", "trickle")
    n = 8

    async def main():
        async with aiohttp.ClientSession() as session:
            body = {"model": stack.model_name, "prompt": "Hello world", "max_tokens": 20, "stream": True}
            responses = await asyncio.gather(*(session.post(f"{stack.gateway_url}/v1/completions", json=body)
                                               for _ in range(n)))
            await asyncio.gather(*(r.content.readline() for r in responses))  # each stream has started
            for r in responses:
                r.close()

    asyncio.run(main())
    assert len(a.generate_calls) + len(b.generate_calls) == n
    assert abs(len(a.generate_calls) - len(b.generate_calls)) <= 1, (a.generate_calls, b.generate_calls)


# ---- status codes of streams (item 8 of issue 8) ----------------------------------------------


def test_a_stream_that_cannot_start_gets_a_real_status_code(stack, fakes):
    # Routing, queueing and the first answer of the decode worker happen before the response
    # starts: a stream that never gets a token is a real 503 (+ Retry-After) or 400, not 200 + SSE.
    (worker,) = fakes("busy")
    with pytest.raises(openai.APIStatusError) as info:
        list(client(stack).completions.create(model=stack.model_name, prompt="Hello world", max_tokens=4,
                                              stream=True))
    assert info.value.status_code == 503 and info.value.response.headers.get("retry-after")
    assert "busy" in info.value.message
    worker.behaviour = "invalid"
    with pytest.raises(openai.BadRequestError, match="rejected by the engine"):
        list(client(stack).completions.create(model=stack.model_name, prompt="Hello world", max_tokens=4,
                                              stream=True))
    worker.behaviour = "stream"
    chunks = list(client(stack).completions.create(model=stack.model_name, prompt="Hello world", max_tokens=4,
                                                   stream=True))
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"


# ---- request bodies (item 9 of issue 8; limits of issue 9) -------------------------------------


def post_raw(stack, data, headers=None) -> tuple[int, dict]:
    async def main():
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{stack.gateway_url}/v1/completions", data=data,
                                    headers={"Content-Type": "application/json", **(headers or {})}) as resp:
                return resp.status, await resp.json()

    return asyncio.run(main())


def test_a_large_body_is_read_whole(stack):
    # ~300 kB arrives in many pieces; reading only what was buffered gave "Input data was truncated".
    body = json.dumps({"model": stack.model_name, "prompt": "hello " * 50_000, "max_tokens": 4}).encode()
    status, payload = post_raw(stack, body)
    assert status == 400 and payload["error"]["code"] == "context_length_exceeded", payload


def test_a_body_over_the_limit_is_refused_while_it_is_read(stack):
    # No Content-Length (chunked): the limit is enforced as the bytes arrive.
    async def chunks():
        yield b'{"model": "m", "prompt": "'
        for _ in range(80):
            yield b"x" * (64 << 10)  # 5 MiB in all, over the 4 MiB default
        yield b'"}'

    status, payload = post_raw(stack, chunks())
    assert status == 413 and payload["error"]["message"].startswith("Request body sent in chunks exceeds the limit of ")


def test_a_compressed_body_over_the_limit_is_refused_by_what_it_inflates_to(stack):
    """48 KB of gzip that inflate to 5 MiB: refused once past the limit, saying so (it named the
    48 KB as exceeding the 4 MiB limit)."""
    body = gzip.compress(json.dumps({"model": "m", "prompt": "x" * (5 << 20)}).encode())
    status, payload = post_raw(stack, body, {"Content-Encoding": "gzip"})
    assert status == 413 and payload["error"]["message"].startswith("Request body (decompressed) exceeds the limit of ")


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_compressed_body_that_does_not_inflate_is_a_400_naming_the_encoding(stack, encoding):
    """It was a plain-text 500 (and an error logged with its traceback)."""
    status, payload = post_raw(stack, b"\x1f\x8b not compressed at all", {"Content-Encoding": encoding})
    assert status == 400 and payload["error"]["code"] == "invalid_request_body", payload
    assert f"content-encoding: {encoding}" in payload["error"]["message"]


# ---- slow and greedy clients (item "slow and greedy clients" of issue 8; limits of issue 9) ---

KEYS = {"greedy": "sk-greedy-0123456789", "other": "sk-other-0123456789"}
MAX_CONNECTIONS = 6


@pytest.fixture(scope="module")
def guarded(stack, tmp_path_factory):
    """A second gateway on the same pools, with API keys (one limited to 2 requests in flight), a
    short write timeout and a connection cap."""
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"# test keys\n{KEYS['greedy']}:2\n\n{KEYS['other']}\n")
    proc = stack.start_gateway("guarded", ["--api-keys-file", str(keys), "--client-write-timeout", "2",
                                           "--max-connections", str(MAX_CONNECTIONS)])
    def answering() -> bool:
        try:
            http_json(f"{proc.url}/health", timeout=2)
        except urllib.error.HTTPError:
            pass  # answering (503 while it has no decode worker)
        except OSError:
            assert proc.popen.poll() is None, proc.log()
            return False
        return True
    wait_until(answering, "the guarded gateway to answer")
    try:
        yield proc.url
    finally:
        proc.popen.terminate()
        proc.popen.wait(15)


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_a_client_that_stops_reading_is_cut_off_and_the_request_aborted(stack, guarded, fakes):
    (flood,) = fakes("flood")
    port = int(guarded.rsplit(":", 1)[1])
    body = json.dumps({"model": stack.model_name, "prompt": "Hello world", "max_tokens": 1000, "stream": True})
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS['other']}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # reads nothing, buffers little
        sock.connect(("127.0.0.1", port))
        sock.sendall(request)
        # The gateway fills what the socket holds, waits --client-write-timeout, cuts the client off
        # and aborts the request upstream (on a real decode worker: its blocks are freed).
        flood.wait_for(lambda: len(flood.aborts) == 1, timeout=60, what="the abort of the stalled stream")
    assert flood.aborts == flood.generate_calls
    assert metric(guarded, "pdserve_client_write_timeouts_total") == 1
    assert metric(guarded, "pdserve_requests_in_flight") == 0


def test_one_api_key_cannot_take_every_slot(stack, guarded, fakes):
    (slow,) = fakes("trickle", trickle_s=0.5)

    async def main():
        async with aiohttp.ClientSession() as session:
            def post(key):
                body = {"model": stack.model_name, "prompt": "Hello world", "max_tokens": 1000, "stream": True}
                return session.post(f"{guarded}/v1/completions", json=body,
                                    headers={"Authorization": f"Bearer {KEYS[key]}"})

            held = [await post("greedy"), await post("greedy")]  # its limit: 2 in flight
            try:
                assert [r.status for r in held] == [200, 200]
                async with post("greedy") as third:
                    assert third.status == 429 and third.headers.get("Retry-After")
                    assert "limit" in (await third.json())["error"]["message"]
                for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
                    async with session.post(f"{guarded}{path}", json=body,  # its tokenizer work is admitted too
                                            headers={"Authorization": f"Bearer {KEYS['greedy']}"}) as tokenized:
                        assert tokenized.status == 429, path
                async with post("other") as other:  # another key is not affected
                    assert other.status == 200
            finally:
                for r in held:
                    r.close()
            for _ in range(200):  # once its streams end, the greedy key is served again
                async with post("greedy") as again:
                    if again.status == 200:
                        return
                await asyncio.sleep(0.05)
            raise AssertionError("the greedy key stayed limited after its streams ended")

    asyncio.run(main())
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded}/v1", api_key="sk-unknown", max_retries=0).models.list()


def health_answer(url: str) -> tuple[int, dict, str]:
    """``GET /health`` on a new connection: status, headers, body."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def test_idle_connections_never_shut_out_a_client_and_busy_ones_at_the_cap_get_503(stack, guarded, fakes):
    port = int(guarded.rsplit(":", 1)[1])
    idle = []
    try:
        for _ in range(MAX_CONNECTIONS):  # open and say nothing
            idle.append(socket.create_connection(("127.0.0.1", port)))
        # The connection idle longest makes room: silent sockets cannot shut clients out (issue 27 H1).
        status, _, text = health_answer(guarded)
        assert "too_many_connections" not in text, (status, text)
    finally:
        for sock in idle:
            sock.close()
    (slow,) = fakes("trickle", trickle_s=0.5)  # 1000 tokens: streams outlast the test

    async def main():
        async with aiohttp.ClientSession() as session:
            body = {"model": stack.model_name, "prompt": "Hello world", "max_tokens": 1000, "stream": True}
            streams = [await session.post(f"{guarded}/v1/completions", json=body,
                                          headers={"Authorization": f"Bearer {KEYS['other']}"})
                       for _ in range(MAX_CONNECTIONS)]
            try:
                assert [r.status for r in streams] == [200] * MAX_CONNECTIONS
                # Every connection is busy with a request: a newcomer is refused, none of them cut.
                status, headers, text = await asyncio.to_thread(health_answer, guarded)
                assert status == 503 and headers.get("Retry-After") and "too_many_connections" in text, text
                await asyncio.gather(*(r.content.readline() for r in streams))  # all still streaming
            finally:
                for r in streams:
                    r.close()

    asyncio.run(main())
    wait_until(lambda: "too_many_connections" not in health_answer(guarded)[2],  # closed connections free places
               "connections to be taken again after the streams closed")


# ---- /health per pool (issue 8) ----------------------------------------------------------------


def test_health_reports_each_pool_and_is_503_without_a_decode_worker(stack):
    def health():
        code, _, text = health_answer(stack.gateway_url)
        return code, json.loads(text)

    code, body = health()
    assert code == 503 and body["status"] == "unavailable"
    assert body["workers"] == {"prefill": 0, "decode": 0, "both": 0} and body["model"] == stack.model_name
    assert body["pools"]["decode"] == {"healthy": 0, "benched": 0} and "redis" in body
    assert any("no healthy decode worker" in p for p in body["problems"])
    with FakeDecodeWorker(stack.redis_url, stack.key_prefix, stack.model_name, f"{uuid.uuid4().hex[:6]}-d",
                          "stream", cluster_secret=stack.cluster_secret) as decode_only:
        stack.wait_for_workers(0, 1)
        code, body = health()
        # No prefill worker: decode workers compute prompts themselves -- degraded, not down.
        assert code == 200 and body["status"] == "degraded"
        assert any("compute prompts themselves" in p for p in body["problems"])
        assert complete(stack).choices[0].finish_reason == "length"
        with FakeDecodeWorker(stack.redis_url, stack.key_prefix, stack.model_name, f"{uuid.uuid4().hex[:6]}-b",
                              "stream", cluster_secret=stack.cluster_secret, role="both"):
            stack.wait_for_workers(0, 1, 1)
            code, body = health()
            assert code == 200 and body["status"] == "ok" and body["problems"] == []
            assert body["pools"] == {"decode": {"healthy": 2, "benched": 0}, "prefill": {"healthy": 1, "benched": 0}}
        assert decode_only.generate_calls
    stack.wait_for_workers(0, 0)
