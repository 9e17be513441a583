"""A real gateway in this process (its app on a test server, real Redis behind a proxy the test can
hold): /health reports Redis as it is now, /metrics names no API key, and a key without its own
limit gets the default per-key limit; an output bound past the context is a 400 naming the API's own
field.  No workers: nothing here needs one -- a background response
waits in the queue for one as long as a test needs it to (it holds its key's slot, not its polls, and
is cancelled, or given up by a stopping gateway), or finds none and ends failed saying so."""
from __future__ import annotations

import asyncio
import gzip
import contextlib
import json
from importlib import metadata

import pytest

from common.engine.kv.prefix_hash import HASH_LEN
from gateway.openai_protocol import OpenAIError
from gateway.response_store import LOST
from tests.support.holdable_proxy import proxied
from tests.support.inprocess_gateway import ADMIN_TOKEN, KEYS, gateway

@pytest.fixture
async def proxy(redis_url):
    async with proxied(redis_url) as proxy:
        yield proxy


async def health(client) -> dict:
    async with client.get("/health") as resp:
        return await resp.json()


class Clock:
    """The Redis probe's clock, moved by the test (how long an answer is kept is not waited for)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_health_reports_redis_as_it_is_now_after_a_slow_prefix_lookup(served_checkpoint, proxy, key_prefix):
    # A lookup may take 2 s (time enough for a PING on a loaded machine); the lookup held below
    # times out after that.  No request comes afterwards: the gateway is idle.
    async with gateway(served_checkpoint, proxy.url, key_prefix, prefix_lookup_timeout=2.0) as (gw, client):
        # The test refreshes the pool itself: a background refresh that timed out while Redis was
        # held could otherwise end after the test's own refresh and say Redis is down.
        await gw.pool.stop()
        gw.redis_probe.clock = clock = Clock()
        assert (await health(client))["redis"] is True
        proxy.hold()
        assert await gw.prefix_index.longest_prefix(gw.model_id, [b"\1" * HASH_LEN], ["w0"]) == {}
        assert not gw.prefix_index.available
        down = await health(client)
        assert down["redis"] is False and any("Redis" in p for p in down["problems"])  # Redis does not answer now
        assert down["status"] != "ok"
        proxy.release()
        await gw.pool.refresh()  # what the registry refresh does twice a second: it reads Redis again
        assert gw.pool.redis_ok
        clock.now += gw.redis_probe.interval_s  # past the time the probe keeps its "no"
        assert (await health(client))["redis"] is True  # it answers now, though no lookup came since


async def test_public_metrics_name_no_api_key_and_keys_have_a_default_limit(served_checkpoint, redis_url,
                                                                           key_prefix, tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text(f"{KEYS['b']}\n")
    # Two keys, --max-inflight 8: a key without its own limit may hold half, 4.
    async with gateway(served_checkpoint, redis_url, key_prefix, api_keys_file=str(keys),
                       max_inflight=8) as (gw, client):
        a, b = (gw.api_keys.authenticate(f"Bearer {KEYS[k]}") for k in "ab")
        async with contextlib.AsyncExitStack() as held:
            for _ in range(4):
                await held.enter_async_context(gw.admission(a))
            with pytest.raises(OpenAIError) as info:
                await held.enter_async_context(gw.admission(a))
            assert info.value.status == 429 and info.value.retry_after and "limit" in info.value.message
            await held.enter_async_context(gw.admission(b))  # another key is not affected
        async with client.get("/metrics") as resp:
            public = await resp.text()
        assert "pdserve_key_limited_total 1.0" in public
        assert a.key_id not in public and b.key_id not in public and "key_id" not in public
        async with client.get("/admin/metrics") as resp:
            assert resp.status == 401
        async with client.get("/admin/metrics", headers={"X-Admin-Token": ADMIN_TOKEN}) as resp:
            assert resp.status == 200
            assert f'pdserve_key_limited_by_key_total{{key_id="{a.key_id}"}} 1.0' in await resp.text()



async def poll(client, response_id: str, headers: dict, until) -> dict:
    while True:
        async with client.get(f"/v1/responses/{response_id}", headers=headers) as resp:
            assert resp.status == 200
            polled = await resp.json()
        if until(polled["status"]):
            return polled
        await asyncio.sleep(0.05)


async def background(client, model: str, headers: dict) -> dict:
    body = {"model": model, "input": "hello", "background": True, "max_output_tokens": 4}
    async with client.post("/v1/responses", json=body, headers=headers) as resp:
        assert resp.status == 200
        queued = await resp.json()
    assert (queued["status"], queued["background"], queued["store"], queued["output"]) == ("queued", True, True, [])
    return queued


async def test_a_background_response_that_finds_no_worker_ends_failed_with_the_reason(served_checkpoint, redis_url,
                                                                                       key_prefix):
    headers = {"Authorization": f"Bearer {KEYS['a']}"}
    async with gateway(served_checkpoint, redis_url, key_prefix, queue_timeout=0.2) as (gw, client):
        queued = await background(client, gw.model_id, headers)
        failed = await poll(client, queued["id"], headers, lambda status: status not in ("queued", "in_progress"))
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        assert "no decode worker" in failed["error"]["message"]
        async with client.post(f"/v1/responses/{queued['id']}/cancel", headers=headers) as resp:
            assert (resp.status, (await resp.json())["status"]) == (200, "failed")  # as it ended
        body = {"model": gw.model_id, "input": "more", "previous_response_id": queued["id"]}
        async with client.post("/v1/responses", json=body, headers=headers) as resp:
            error = (await resp.json())["error"]
        assert (resp.status, error["param"], error["code"]) == (400, "previous_response_id", "response_not_continuable")


async def test_a_waiting_background_response_holds_its_keys_slot_until_cancelled(served_checkpoint, redis_url,
                                                                                  key_prefix, tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text(f"{KEYS['b']}:1\n")
    headers = {"Authorization": f"Bearer {KEYS['b']}"}
    # No decode worker: the run waits in the queue (as long as the test needs) for one.
    async with gateway(served_checkpoint, redis_url, key_prefix, api_keys_file=str(keys),
                       queue_timeout=600) as (gw, client):
        queued = await background(client, gw.model_id, headers)
        polled = await poll(client, queued["id"], headers, lambda status: True)
        assert polled["status"] == "queued"  # polled all the same
        body = {"model": gw.model_id, "input": "another", "max_output_tokens": 4}
        async with client.post("/v1/responses", json=body, headers=headers) as resp:
            assert resp.status == 429  # the key's one slot is the run's
        async with client.post(f"/v1/responses/{queued['id']}/cancel", headers=headers) as resp:
            assert (resp.status, (await resp.json())["status"]) == (200, "cancelled")
        async with asyncio.timeout(120):  # (a hang guard)
            while gw.admission.inflight:  # the run ends, and lets its slot go
                await asyncio.sleep(0.01)
        assert (await poll(client, queued["id"], headers, lambda status: True))["status"] == "cancelled"


async def test_a_stopping_gateway_gives_its_background_responses_up(served_checkpoint, redis_url, key_prefix):
    headers = {"Authorization": f"Bearer {KEYS['a']}"}
    async with gateway(served_checkpoint, redis_url, key_prefix, queue_timeout=600) as (gw, client):
        queued = await background(client, gw.model_id, headers)
        assert (await poll(client, queued["id"], headers, lambda status: True))["status"] == "queued"
    # Read by another gateway: failed at once (not when its lease would lapse).
    async with gateway(served_checkpoint, redis_url, key_prefix) as (gw, client):
        failed = await poll(client, queued["id"], headers, lambda status: True)
    assert (failed["status"], failed["error"]["code"], failed["error"]["message"]) == ("failed", "server_error", LOST)


async def test_a_streamed_background_response_goes_on_without_its_client_and_is_streamed_again(
        served_checkpoint, redis_url, key_prefix):
    headers = {"Authorization": f"Bearer {KEYS['a']}"}
    body = {"model": served_checkpoint.name, "input": "hello", "background": True, "stream": True,
            "max_output_tokens": 4}
    async with gateway(served_checkpoint, redis_url, key_prefix, queue_timeout=0.5) as (gw, client):
        async with client.post("/v1/responses", json=body, headers=headers) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            created = await resp.content.readuntil(b"\n\n")  # at once, before any token
        assert created.startswith(b"event: response.created\n")  # ... and the client goes
        response_id = json.loads(created.split(b"data: ", 1)[1])["response"]["id"]
        failed = await poll(client, response_id, headers, lambda status: status not in ("queued", "in_progress"))
        assert failed["status"] == "failed" and "no decode worker" in failed["error"]["message"]
        assert failed["store"] is True  # (a failed stream is not stored, but a background one is)

        async def streamed(query: str) -> list[dict]:
            async with client.get(f"/v1/responses/{response_id}?stream=true{query}", headers=headers) as resp:
                assert resp.status == 200
                text = await resp.text()
            return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]

        events = await streamed("")
        assert [(e["type"], e["sequence_number"]) for e in events] == [
            ("response.created", 0), ("response.queued", 1), ("response.failed", 2)]
        assert events[-1]["response"] == failed
        assert await streamed("&starting_after=1") == events[2:]
        async with client.get(f"/v1/responses/{response_id}?stream=true&starting_after=x", headers=headers) as resp:
            assert (resp.status, (await resp.json())["error"]["param"]) == (400, "starting_after")


async def test_a_streamed_background_response_sends_its_id_at_once_and_ends_when_cancelled(
        served_checkpoint, redis_url, key_prefix):
    headers = {"Authorization": f"Bearer {KEYS['a']}"}
    body = {"model": served_checkpoint.name, "input": "hello", "background": True, "stream": True}
    # No decode worker: the run waits for one as long as the test needs; its first events come at once.
    async with gateway(served_checkpoint, redis_url, key_prefix, queue_timeout=600) as (gw, client):
        async with client.post("/v1/responses", json=body, headers=headers) as stream:
            async with asyncio.timeout(120):  # (a hang guard)
                created = await stream.content.readuntil(b"\n\n")
            response_id = json.loads(created.split(b"data: ", 1)[1])["response"]["id"]
            async with client.post(f"/v1/responses/{response_id}/cancel", headers=headers) as resp:
                assert (await resp.json())["status"] == "cancelled"
            async with asyncio.timeout(120):
                rest = await stream.read()  # the client's stream ends too
        assert rest.startswith(b"event: response.queued\n") and rest.count(b"event: ") == 1
        async with client.get(f"/v1/responses/{response_id}?stream=true", headers=headers) as resp:
            async with asyncio.timeout(120):
                text = await resp.text()  # what it made, and no more: it ended without a last event
        assert [line for line in text.splitlines() if line.startswith("event: ")] == [
            "event: response.created", "event: response.queued"]


@pytest.mark.parametrize("path, body, field", [
    ("/v1/responses", {"input": "hi", "max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 6}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10 ** 6},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 6}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10 ** 6}, "max_tokens"),
])
async def test_an_output_bound_past_the_context_is_a_400_naming_the_apis_own_field(served_checkpoint, redis_url,
                                                                                   key_prefix, path, body, field):
    headers = {"Authorization": f"Bearer {KEYS['a']}"}
    async with gateway(served_checkpoint, redis_url, key_prefix) as (gw, client):
        async with client.post(path, json={"model": gw.model_id, **body}, headers=headers) as resp:
            error = await resp.json()
        assert resp.status == 400, error
        detail = error["error"]
        assert (detail.get("param", field), "context length" in detail["message"]) == (field, True), error
        assert detail["message"].endswith(f"Please reduce the prompt or {field}."), error  # (the field it was sent as)


async def test_a_grammar_waiting_for_busy_compile_threads_is_a_503_to_retry_not_a_400(served_checkpoint, redis_url,
                                                                                       key_prefix):
    """Other requests' grammars hold both compile threads past the time limit: a valid schema is told
    to retry (503, Retry-After), not refused as invalid; once the threads are free it compiles."""
    import threading

    headers = {"Authorization": f"Bearer {KEYS['a']}"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    async with gateway(served_checkpoint, redis_url, key_prefix, queue_timeout=0.5) as (gw, client):
        body = {"model": gw.model_id, "prompt": "x", "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
        held = threading.Event()
        gw.grammars.timeout_s = 0.5
        holders = [gw.grammars._pool.submit(held.wait, 30) for _ in range(2)]  # (both threads, as long compiles)
        async with client.post("/v1/completions", json=body, headers=headers) as resp:
            busy = await resp.json()
            assert resp.status == 503 and resp.headers["Retry-After"], busy
        assert (busy["error"]["code"], busy["error"]["param"]) == ("grammar_compiler_busy", "response_format"), busy
        held.set()
        await asyncio.wrap_future(holders[1])
        async with client.post("/v1/completions", json=body, headers=headers) as resp:
            later = await resp.json()  # (the grammar passes; no decode worker answers in this test)
        assert later["error"]["code"] != "grammar_compiler_busy", later


@pytest.mark.parametrize("content_type, refused", [
    ("text/plain;charset=UTF-8", True), ("application/x-www-form-urlencoded", True),  # a browser's, cross-site
    ("multipart/form-data; boundary=x", True), ("application/octet-stream", True),
    (None, True),  # a Blob's, and python requests' data=
    ("application/json", False), ("Application/JSON; charset=utf-8", False), ("application/merge-patch+json", False)])
async def test_a_body_is_read_as_json_only_when_it_says_so(served_checkpoint, redis_url, key_prefix, content_type,
                                                          refused):
    """A web page can post text to a gateway on its user's machine without the browser asking first
    (a form's types, ``text/plain``): it is refused, as any body that says it is not JSON."""
    headers = {"Authorization": f"Bearer {KEYS['a']}"}
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1, "text": "hi"})
    async with gateway(served_checkpoint, redis_url, key_prefix) as (gw, client):
        for path in ("/v1/completions", "/tokenize", "/v1/conversations"):
            kw = {"headers": {**headers, "Content-Type": content_type}} if content_type else {
                "headers": headers, "skip_auto_headers": ["Content-Type"]}
            async with client.post(path, data=body.encode(), **kw) as resp:
                answer = await resp.json()
            if refused:
                got = f"got {content_type!r}" if content_type else "and the request has none"
                assert (resp.status, answer["error"]["code"]) == (415, "unsupported_media_type"), answer
                assert answer["error"]["message"] == f"Content-Type must be application/json, {got}"
            else:
                assert resp.status != 415, answer
        async with client.post("/v1/conversations", headers=headers, skip_auto_headers=["Content-Type"]) as resp:
            assert resp.status == 200  # no body, no type: nothing to read (a conversation's body may be left out)


async def test_a_body_in_an_encoding_the_gateway_cannot_read_is_a_415_naming_it(served_checkpoint, redis_url,
                                                                                 key_prefix):
    """(An unknown one was read as if it were none.)"""
    headers = {"Authorization": f"Bearer {KEYS['a']}", "Content-Type": "application/json"}
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}).encode()
    async with gateway(served_checkpoint, redis_url, key_prefix) as (gw, client):
        for encoding in ("bogus", "x-gzip"):  # (br, zstd: aiohttp's parser refuses them, the listener's 415)
            async with client.post("/v1/completions", data=body, headers={**headers, "Content-Encoding": encoding}) as resp:
                answer = await resp.json()
            assert (resp.status, answer["error"]["code"]) == (415, "unsupported_content_encoding"), answer
            assert f"Content-Encoding '{encoding}' is not supported" in answer["error"]["message"]
        async with client.post("/v1/completions", data=gzip.compress(body), headers={**headers, "Content-Encoding": "GZip"}) as resp:
            assert resp.status != 415


async def test_vllms_probe_routes_answer_without_a_key(served_checkpoint, redis_url, key_prefix):
    """``/ping`` answers as ``/health`` does (here 503: no decode worker), ``/version`` and ``/load``
    say what vLLM's do; a request held in flight is the load."""
    async with gateway(served_checkpoint, redis_url, key_prefix) as (gw, client):
        for method in ("GET", "POST"):
            async with client.request(method, "/ping") as resp:
                assert resp.status == 503 and await resp.read() == b""
        async with client.get("/version") as resp:
            assert resp.status == 200 and (await resp.json())["version"] == metadata.version("pdserve")
        async with client.get("/load") as resp:
            assert await resp.json() == {"server_load": 0}
        async with gw.admission(gw.api_keys.authenticate(f"Bearer {KEYS['a']}")):
            async with client.get("/load") as resp:
                assert await resp.json() == {"server_load": 1}


async def test_the_grammar_backend_is_built_before_the_gateway_serves(served_checkpoint, redis_url, key_prefix):
    """(Built at the first grammar, it held the GIL for seconds: every stream of the process stalled.)"""
    async with gateway(served_checkpoint, redis_url, key_prefix) as (gw, _):
        assert gw.grammars.backend_ready


async def raw_status(client, head: bytes) -> int:
    """The status of a request sent as these bytes (headers aiohttp's client would not send)."""
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    try:
        writer.write(head + b"Host: test\r\nConnection: close\r\n\r\n")
        return int((await asyncio.wait_for(reader.readline(), 60)).split()[1])
    finally:
        writer.close()


async def test_credentials_are_read_as_sent_once_in_any_case_of_bearer(served_checkpoint, redis_url, key_prefix):
    """The key right but ``bearer`` in lower case: in (RFC 9110: the scheme is case-insensitive);
    bytes that are not UTF-8 in a key or the admin token: 401, not a 400 in Python's words; a key
    sent twice, the right one first: 401 (which one a proxy in front checked cannot be known)."""
    key, wrong = KEYS["a"].encode(), b"sk-wrong"
    async with gateway(served_checkpoint, redis_url, key_prefix) as (_gw, client):
        get_models = b"GET /v1/models HTTP/1.1\r\n"
        assert await raw_status(client, get_models + b"Authorization: bearer " + key + b"\r\n") == 200
        assert await raw_status(client, get_models + b"Authorization: Bearer " + key + b"\r\n") == 200
        assert await raw_status(client, get_models + b"Authorization: Bearer \x80" + key + b"\r\n") == 401
        assert await raw_status(client, get_models + b"x-api-key: \xff\r\n") == 401
        assert await raw_status(client, get_models + b"Authorization: Bearer " + key + b"\r\n"
                                + b"Authorization: Bearer " + wrong + b"\r\n") == 401
        assert await raw_status(client, get_models + b"x-api-key: " + key + b"\r\nx-api-key: " + wrong + b"\r\n") == 401
        admin = b"GET /admin/pools HTTP/1.1\r\n"
        assert await raw_status(client, admin + b"X-Admin-Token: " + ADMIN_TOKEN.encode() + b"\r\n") == 200
        assert await raw_status(client, admin + b"X-Admin-Token: \x80\r\n") == 401
        assert await raw_status(client, admin + b"X-Admin-Token: " + ADMIN_TOKEN.encode() + b"\r\n"
                                + b"X-Admin-Token: " + wrong + b"\r\n") == 401


async def test_a_function_call_output_answering_no_call_is_a_400(served_checkpoint, redis_url, key_prefix):
    """The Responses API, as OpenAI's: a ``function_call_output`` whose call was never made is refused
    before anything is generated (a count of its input tokens too)."""
    headers = {"Authorization": f"Bearer {KEYS['a']}"}
    output = {"type": "function_call_output", "call_id": "call_nowhere", "output": "42"}
    async with gateway(served_checkpoint, redis_url, key_prefix) as (gw, client):
        for path in ("/v1/responses", "/v1/responses/input_tokens"):
            async with client.post(path, json={"model": gw.model_id, "input": [output]}, headers=headers) as resp:
                error = (await resp.json())["error"]
            assert resp.status == 400 and (error["param"], error["code"]) == ("input", "function_call_not_found"), error
            assert error["message"] == "No tool call found for function call output with call_id call_nowhere."


async def test_a_tools_invalid_parameters_schema_is_a_400_whatever_tool_choice_says(served_checkpoint, redis_url,
                                                                                     key_prefix):
    """OpenAI's API refuses an invalid function schema always; only a forced call (whose grammar is
    the schema) was refused here, ``auto`` and ``none`` were served."""
    headers = {"Authorization": f"Bearer {KEYS['a']}"}
    bad = {"type": "object", "properties": {"city": {"type": "strnig"}}}
    tools = [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "weather", "parameters": bad}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    async with gateway(served_checkpoint, redis_url, key_prefix) as (gw, client):
        for choice in ("auto", "none", None, {"type": "function", "function": {"name": "ok"}}):
            body = {"model": gw.model_id, "messages": messages, "tools": tools, "max_tokens": 4,
                    **({"tool_choice": choice} if choice else {})}
            async with client.post("/v1/chat/completions", json=body, headers=headers) as resp:
                error = (await resp.json())["error"]
            assert resp.status == 400 and (error["param"], error["code"]) == ("tools[1]", "invalid_grammar"), error
        anthropic = {"model": gw.model_id, "max_tokens": 4, "messages": messages,
                     "tools": [{"name": "weather", "input_schema": bad}]}
        async with client.post("/v1/messages", json=anthropic, headers=headers) as resp:
            assert resp.status == 400, await resp.text()
