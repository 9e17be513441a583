"""The served system end to end: real gateway, prefill and decode processes, real Redis, the
official openai client.  Outputs must equal the offline engine's greedy outputs.

Each test passes alone and in any order: a test that checks where a request ran sends prompts no
other test sends (a prompt the decode worker already caches may skip the prefill pool).  No fault
is injected here, so no request may fall back to computing its prompt on the decode worker."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.error
import urllib.request

import openai
import pytest
import redis

from common.engine.config import EngineConfig
from common.engine.core_turns import CoreTurns
from common.engine.engine import Engine
from tests.support.cluster import http_json, running_cluster
from tests.support.serving import BLOCK_SIZE, WORKER_ARGS, wait_idle
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow(seconds=10)  # a long file: scheduled by its length (tests/conftest.py)

API_KEY = "sk-test-key-0123456789"  # the gateway refuses keys under 16 characters
SKIP_PREFILL_BELOW = 8  # prompts with fewer uncached tokens go straight to the decode worker
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then",
    "KV cache blocks move from the prefill worker",
    "Streaming tokens to many concurrent clients is what",
    "Hello",
]
GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def checkpoint(served_checkpoint):
    return served_checkpoint


@pytest.fixture(scope="module")
def decode_turns(tmp_path_factory):
    """The decode worker's core-turns lock (common/engine/core_turns.py): a test that takes a turn on it
    holds the worker between two steps, with its requests in flight."""
    return tmp_path_factory.mktemp("turns") / "d0.lock"


@pytest.fixture(scope="module")
def stack(checkpoint, redis_url, tmp_path_factory, decode_turns):
    with running_cluster(checkpoint, tmp_path_factory.mktemp("logs"), redis_url, prefill=2, decode=1,
                         worker_args=WORKER_ARGS, role_args={"decode": ["--core-turns", str(decode_turns)]},
                         gateway_args=["--api-key", API_KEY, "--skip-prefill-below", str(SKIP_PREFILL_BELOW),
                                       "--max-inflight", "24"]) as c:
        yield c


@pytest.fixture(autouse=True)
def no_prefill_fallbacks(stack):
    """No fault is injected in this module: every remote prefill must succeed."""
    yield
    assert stack.stats("d0")["remote_prefill_fallbacks"] == 0


def pool_counters(stack) -> tuple[float, float]:
    """(prompt tokens the prefill pool handled, KV bytes the decode worker received) so far."""
    handled = sum(stack.stats(p)["prefill_computed_tokens"] + stack.stats(p)["prefill_cached_tokens"]
                  for p in ("p0", "p1"))
    return handled, stack.stats("d0")["kv_received_bytes"]


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The offline engine's greedy text for a prompt (same checkpoint, same tokenizer)."""
    engine = Engine(EngineConfig(model=str(checkpoint), num_blocks=256, block_size=4))
    cache = {}

    def run(prompt, max_tokens=12, chat=False):
        key = (prompt if isinstance(prompt, str) else json.dumps(prompt), max_tokens)
        if key not in cache:
            ids = engine.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)["input_ids"] \
                if chat else engine.tokenizer(prompt).input_ids
            result = engine.generate([ids], {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})[0]
            cache[key] = result
        return cache[key]

    return run


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=API_KEY, max_retries=0)


def aclient(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.gateway_url}/v1", api_key=API_KEY, max_retries=0)


def test_models_and_health(stack):
    models = client(stack).models.list()
    assert [m.id for m in models.data] == [stack.model_name]
    assert client(stack).models.retrieve(stack.model_name).id == stack.model_name
    for other in ("other-model", f"org/{stack.model_name}"):
        with pytest.raises(openai.NotFoundError) as info:
            client(stack).models.retrieve(other)
        assert info.value.body["code"] == "model_not_found" and other in info.value.body["message"]
    health = http_json(f"{stack.gateway_url}/health")
    assert health["workers"] == {"prefill": 2, "decode": 1, "both": 0} and health["redis"] is True


def test_completions_equal_offline_engine(stack, reference):
    """Each prompt of 8+ tokens really goes through the prefill pool (its KV is shipped to the
    decoder, no fallback); a shorter one goes straight to the decode worker."""
    c = client(stack)
    for prompt in [f"{p} (parity)" for p in PROMPTS[:3]] + ["Hello"]:
        before = pool_counters(stack)
        response = c.completions.create(model=stack.model_name, prompt=prompt, **GREEDY)
        after = pool_counters(stack)
        expected = reference(prompt)
        assert response.choices[0].text == expected.text
        assert response.choices[0].finish_reason == "length"
        assert response.usage.completion_tokens == 12
        assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
        if len(expected.prompt_token_ids) >= SKIP_PREFILL_BELOW:
            assert after[0] - before[0] == len(expected.prompt_token_ids) and after[1] > before[1], prompt
        else:
            assert after == before, prompt


def test_streaming_completion_equals_non_streaming(stack, reference):
    c = client(stack)
    prompt = PROMPTS[0]
    chunks = list(c.completions.create(model=stack.model_name, prompt=prompt, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == reference(prompt).text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_completions_streaming_and_not(stack, reference):
    c = client(stack)
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": "Hello world!"}]
    expected = reference(messages, chat=True).text
    response = c.chat.completions.create(model=stack.model_name, messages=messages, **GREEDY)
    assert response.choices[0].message.content == expected
    assert response.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model=stack.model_name, messages=messages, stream=True, **GREEDY)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == expected


def test_many_concurrent_streams(stack, reference):
    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(16)]

    async def one(c, prompt):
        stream = await c.completions.create(model=stack.model_name, prompt=prompt, stream=True, **GREEDY)
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def main():
        c = aclient(stack)
        try:
            return await asyncio.gather(*(one(c, p) for p in prompts))
        finally:
            await c.close()

    texts = asyncio.run(main())
    assert texts == [reference(p).text for p in prompts]


def test_prefix_routing_sends_shared_prefix_to_the_same_prefill_worker(stack, reference):
    c = client(stack)
    system = "You are a helpful assistant; answer briefly. " * 6
    before = {p: stack.stats(p)["prefill_computed_tokens"] for p in ("p0", "p1")}
    first = c.completions.create(model=stack.model_name, prompt=system + "Question one?", **GREEDY)
    after_first = {p: stack.stats(p)["prefill_computed_tokens"] for p in ("p0", "p1")}
    served = [p for p in before if after_first[p] > before[p]]
    assert len(served) == 1
    # Hold what routing needs: the serving worker's cached blocks published in the prefix index (a
    # background task publishes them).  The suffix is long enough that the prompt goes through the
    # prefill pool even where the decode worker caches the prefix too.
    full_blocks = first.usage.prompt_tokens // BLOCK_SIZE
    blocks_key = f"{stack.key_prefix}:{stack.model_name}:blocks:{served[0]}"
    index = redis.Redis.from_url(stack.redis_url)
    try:
        wait_until(lambda: index.scard(blocks_key) >= full_blocks, f"{served[0]}'s blocks in the prefix index")
    finally:
        index.close()
    second_prompt = system + "Second question, a longer one, about several more things at once, please?"
    second = c.completions.create(model=stack.model_name, prompt=second_prompt, **GREEDY)
    after_second = {p: stack.stats(p)["prefill_computed_tokens"] for p in ("p0", "p1")}
    delta = {p: after_second[p] - after_first[p] for p in before}
    other = [p for p in before if p != served[0]][0]
    assert delta[other] == 0, "the shared prefix went to the other prefill worker"
    prompt_len = second.usage.prompt_tokens
    assert 0 < delta[served[0]] < prompt_len - 40  # only the suffix was computed
    assert second.usage.prompt_tokens_details.cached_tokens >= 40
    assert second.choices[0].text == reference(second_prompt).text
    assert first.choices[0].text == reference(system + "Question one?").text


def test_stop_string_truncates_and_aborts(stack, reference):
    c = client(stack)
    prompt = PROMPTS[0]
    full = reference(prompt, max_tokens=40).text
    stop = full[5:8]
    assert stop and stop in full
    response = c.completions.create(model=stack.model_name, prompt=prompt, temperature=0, max_tokens=40,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].text == full[: full.index(stop)]
    wait_idle(stack, "d0")


def generate_outcomes(stack, worker: str) -> dict[str, float]:
    """``worker``'s finished /generate requests by outcome (``pdserve_worker_requests_total``)."""
    counts = {}
    for line in stack.worker_metrics(worker).splitlines():
        if line.startswith("pdserve_worker_requests_total{") and 'kind="generate"' in line:
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            counts[outcome] = float(line.split()[-1])
    return counts


def test_client_disconnect_aborts_on_the_workers(stack, decode_turns):
    c = client(stack)
    before = generate_outcomes(stack, "d0")
    stream = c.completions.create(model=stack.model_name, prompt=PROMPTS[1], stream=True, temperature=0,
                                  max_tokens=1000, extra_body={"ignore_eos": True})
    iterator = iter(stream)
    next(iterator)
    next(iterator)
    # The decode worker is held between two steps (a turn on its core-turns lock) while the test reads
    # its load and disconnects: under the hold the stream cannot end, however slow the machine, and the
    # abort is on its way before the worker steps again (it would step without its turn only after
    # core_turns.WAIT_LIMIT_S).  Before the hold, the stream's 1000 tokens are the window.
    with contextlib.closing(CoreTurns(decode_turns)) as turns, turns.turn() as held:
        assert held
        assert stack.stats("d0")["inflight"] == 1, "the stream in flight on d0"
        disconnected = time.monotonic()
        stream.close()
        wait_until(lambda: generate_outcomes(stack, "d0").get("aborted", 0) > before.get("aborted", 0),
                   "d0's handler to see the disconnect")
        released = time.time()
    stats = wait_idle(stack, "d0")
    for p in ("p0", "p1"):
        wait_idle(stack, p)
    assert stats["num_free_blocks"] == stats["num_blocks"]
    # Cut short, not run to its length: the step the worker was waiting to take, then the abort (a
    # stream left running would take hundreds more).
    steps_after = stack.worker_json("d0", f"/admin/steps?since={released}")["steps"]
    assert len(steps_after) <= 2, steps_after
    after = generate_outcomes(stack, "d0")
    assert after.get("aborted", 0) == before.get("aborted", 0) + 1, (before, after)
    assert after.get("length", 0) == before.get("length", 0), (before, after)
    print(f"aborted on the decode worker {time.monotonic() - disconnected:.3f} s after the disconnect")


def post(stack, path: str, body: bytes, headers: dict | None = None):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(f"{stack.gateway_url}{path}", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    (json.dumps({"model": "M", "prompt": "hi", "frobnicate": 1}).encode(), 400, "frobnicate"),
    (json.dumps({"model": "M", "prompt": "hi", "temperature": 7}).encode(), 400, "temperature"),
    (json.dumps({"model": "M", "prompt": "hi", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "M", "prompt": "hi " * 600, "max_tokens": 600}).encode(), 400, "context length"),
    (json.dumps({"model": "M", "prompt": "hi", "n": 17}).encode(), 400, "<= 16"),
    (json.dumps({"model": "other-model", "prompt": "hi"}).encode(), 404, "does not exist"),
])
def test_bad_input_gets_openai_shaped_errors(stack, body, status, needle):
    body = body.replace(b'"M"', json.dumps(stack.model_name).encode())
    code, payload, _ = post(stack, "/v1/completions", body)
    assert code == status
    assert needle in payload["error"]["message"]
    assert set(payload["error"]) >= {"message", "type", "param", "code"}


def test_oversized_body_is_413(stack):
    code, payload, _ = post(stack, "/v1/completions", b'{"prompt": "' + b"x" * (5 << 20) + b'"}')
    assert code == 413 and "exceeds" in payload["error"]["message"]


def test_wrong_api_key_is_401(stack):
    bad = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=stack.model_name, prompt="hi", max_tokens=2)


def test_saturation_answers_429_with_retry_after(stack):
    async def one(c):
        try:
            stream = await c.completions.create(model=stack.model_name, prompt=PROMPTS[2], stream=True,
                                                temperature=0, max_tokens=60, extra_body={"ignore_eos": True})
            return len([ch async for ch in stream if ch.choices and ch.choices[0].text is not None])
        except openai.RateLimitError as exc:
            return exc.response.headers.get("retry-after")

    async def main():
        c = aclient(stack)
        try:
            return await asyncio.gather(*(one(c) for _ in range(40)))
        finally:
            await c.close()

    results = asyncio.run(main())
    rejected = [r for r in results if isinstance(r, str)]
    served = [r for r in results if isinstance(r, int)]
    assert rejected and all(r == "1" for r in rejected)  # 429 with Retry-After, never an unbounded queue
    assert served and all(n > 0 for n in served)
    wait_idle(stack, "d0")


def test_metrics_are_exported(stack, reference):
    prompt = f"{PROMPTS[1]} (metrics)"  # through the prefill pool: KV moves
    assert client(stack).completions.create(model=stack.model_name, prompt=prompt, **GREEDY).choices[0].text == \
        reference(prompt).text
    with urllib.request.urlopen(f"{stack.gateway_url}/metrics") as resp:
        text = resp.read().decode()
    for name in ("pdserve_time_to_first_token_seconds", "pdserve_inter_token_latency_seconds",
                 "pdserve_e2e_request_latency_seconds", "pdserve_kv_cache_usage_ratio",
                 "pdserve_prefix_cache_hit_tokens_total", "pdserve_kv_transfer_bytes_total",
                 "pdserve_num_requests_waiting"):
        assert name in text
    transferred = [line for line in text.splitlines() if line.startswith("pdserve_kv_transfer_bytes_total")]
    assert float(transferred[0].split()[-1]) > 0
