"""Peers the cluster must not trust: a worker forged straight into Redis, and a registered prefill
worker that answers garbage.  Real processes (gateway, 1 prefill + 1 decode worker), real Redis,
the official openai client; the hostile parties are small servers in this test."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import uuid

import aiohttp
import msgspec
import openai
import pytest
import redis
from aiohttp import web

from common.cluster.auth import ClusterAuth
from common.cluster.messages import (
    GenerateRequest, PrefillResult, TokenFrame, TokenLogprob, decode, encode, read_frame,
)
from common.cluster.redis_keys import RedisKeys
from common.cluster.registry import Capacity, KVAddress, WorkerInfo, WorkerRegistry, seal_entry
from common.engine.sampling_params import SamplingParams
from tests.support.cluster import ADMIN_TOKEN, http_json, running_cluster

pytestmark = pytest.mark.slow(seconds=15)  # a long file: scheduled by its length (tests/conftest.py)

WORKER_ARGS = ["--num-blocks", "256", "--block-size", "4", "--max-num-batched-tokens", "32"]
PROMPT = "KV cache blocks move from the prefill worker to the decode worker over UCX. "


@pytest.fixture(scope="module")
def cluster(served_checkpoint, tmp_path_factory, redis_url):
    with running_cluster(served_checkpoint, tmp_path_factory.mktemp("untrusted"), redis_url, prefill=1, decode=1,
                         worker_args=WORKER_ARGS, gateway_args=["--skip-prefill-below", "8"]) as c:
        yield c


def completion(cluster, prompt: str, max_tokens: int = 6):
    client = openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="x", max_retries=0, timeout=120)
    return client.completions.create(model=cluster.model_name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True})


def gateway_metric(cluster, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"{cluster.gateway_url}/metrics", timeout=10) as resp:
        return sum(float(line.split()[-1]) for line in resp.read().decode().splitlines()
                   if line.startswith(name + " ") or line.startswith(name + "{"))


class Honeypot:
    """A TCP listener that records every connection made to it (whatever the protocol)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    self.received.append(conn.recv(65536))
                except OSError:
                    self.received.append(b"")

    def close(self) -> None:
        self._stop = True
        self.thread.join(5)
        self.sock.close()


def forged_entry(worker_id: str, role: str, model: str, port: int) -> WorkerInfo:
    """What an attacker with Redis access writes: an idle, active worker at an address it controls."""
    return WorkerInfo(worker_id=worker_id, role=role, model=model, http_address=f"http://127.0.0.1:{port}",
                      kv_address=KVAddress("tcp", "127.0.0.1", port),
                      capacity=Capacity(num_kv_blocks=100000, block_size=4, max_num_seqs=256), state="active",
                      heartbeat_at=time.time(), started_at=time.time())


def test_forged_registry_entries_never_receive_a_prompt_or_a_token(cluster, redis_url):
    honeypot = Honeypot()
    client = redis.Redis.from_url(redis_url)
    keys = RedisKeys(cluster.key_prefix, cluster.model_name)
    wrong_secret = ClusterAuth("not-the-cluster-secret-0123456789")
    forged = {
        "evil-prefill": msgspec.json.encode(forged_entry("evil-prefill", "prefill", cluster.model_name, honeypot.port)),
        "evil-decode": msgspec.json.encode(forged_entry("evil-decode", "decode", cluster.model_name, honeypot.port)),
        "evil-both": seal_entry(msgspec.json.encode(forged_entry("evil-both", "both", cluster.model_name,
                                                                 honeypot.port)), wrong_secret),
    }
    try:
        for worker_id, raw in forged.items():
            client.set(keys.worker(worker_id), raw, px=120_000)
            client.zadd(keys.workers, {worker_id: time.time() * 1000 + 120_000})
        # /admin/pools re-reads the registry, so the routing pool is fresh from here on.
        pools = http_json(f"{cluster.gateway_url}/admin/pools", headers={"X-Admin-Token": ADMIN_TOKEN})
        assert {w["worker_id"] for w in pools["workers"]} == {"p0", "d0"}
        for worker_id in forged:  # the admin proxy does not know them
            with pytest.raises(urllib.error.HTTPError) as err:
                http_json(f"{cluster.gateway_url}/admin/workers/{worker_id}/drain", "POST", b"{}",
                          {"X-Admin-Token": ADMIN_TOKEN})
            assert err.value.code == 404
        for i in range(6):
            answer = completion(cluster, f"{PROMPT} question {i}?")
            assert answer.choices[0].finish_reason == "length"
        assert gateway_metric(cluster, "pdserve_registry_rejected_entries_total") > 0
        assert honeypot.received == [], "a forged worker was contacted"
    finally:
        for worker_id in forged:
            client.delete(keys.worker(worker_id))
            client.zrem(keys.workers, worker_id)
        client.close()
        honeypot.close()


# ---- a registered prefill worker that answers garbage ----------------------------------------


@pytest.fixture(scope="module")
def reference(served_checkpoint):
    """Greedy continuation of token ids by the offline engine (what every answer must equal)."""
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(served_checkpoint), num_blocks=256, block_size=4), load_tokenizer=False)
    return lambda ids, n: engine.generate([ids], {"max_tokens": n, "temperature": 0, "ignore_eos": True})[0].token_ids


def prompt_ids(seed: int, length: int = 41) -> list[int]:
    return [3 + (seed * 31 + i * 7) % 400 for i in range(length)]


async def generate(cluster, prompt: list[int], max_tokens: int, prefill_worker_id: str | None,
                   logprobs: int | None = None, prompt_logprobs: int | None = None) -> list[TokenFrame]:
    """POST /generate on d0 as the gateway does (signed); all frames of the answer."""
    body = encode(GenerateRequest(request_id=f"t-{uuid.uuid4().hex[:8]}", prompt_token_ids=prompt,
                                  sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                 ignore_eos=True, logprobs=logprobs,
                                                                 prompt_logprobs=prompt_logprobs),
                                  prefill_worker_id=prefill_worker_id))
    headers = ClusterAuth(cluster.cluster_secret).sign_request("POST", "/generate", body,
                                                               audience=cluster.worker_audience("d0"))
    frames = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(cluster.worker_url("d0") + "/generate", data=body, headers=headers) as resp:
            while (item := await read_frame(resp.content, TokenFrame)) is not None:
                frames.append(item)
    return frames


def tokens(frames: list[TokenFrame]) -> list[int]:
    return [t for f in frames for t in f.token_ids]


class EvilPrefill:
    """A prefill worker registered with a valid signature (it holds the secret) whose answers are
    wrong: it relays each /prefill to the real prefill worker p0, so the KV really lands on the
    decode worker, then tampers with the result according to ``mode``."""

    def __init__(self, cluster, mode: str):
        self.cluster, self.mode = cluster, mode
        self.worker_id = f"evil-{mode}"
        self.auth = ClusterAuth(cluster.cluster_secret)
        self.calls = 0
        self.bytes_written = 0
        self.p0 = cluster.worker_audience("p0")  # where it relays

    async def start(self, redis_client) -> "EvilPrefill":
        app = web.Application()
        app.router.add_post("/prefill", self.prefill)
        app.router.add_post("/abort", self.abort)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        registry = WorkerRegistry(redis_client, key_prefix=self.cluster.key_prefix, ttl_s=120, auth=self.auth)
        self.registry = registry
        await registry.register(forged_entry(self.worker_id, "prefill", self.cluster.model_name, port))
        return self

    async def stop(self) -> None:
        await self.registry.deregister(self.cluster.model_name, self.worker_id)
        await self.runner.cleanup()

    async def abort(self, _request: web.Request) -> web.Response:
        return web.Response(body=b"{}")

    async def prefill(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        body = await request.read()
        headers = self.auth.sign_request("POST", "/prefill", body, audience=self.p0)
        async with aiohttp.ClientSession() as session:
            async with session.post(self.cluster.worker_url("p0") + "/prefill", data=body, headers=headers) as resp:
                genuine = decode(await resp.read(), PrefillResult)
        assert genuine.error is None, genuine.error
        if self.mode == "endless":
            response = web.StreamResponse()
            await response.prepare(request)
            chunk = encode(genuine) * 1 + b"\x00" * (1 << 20)
            try:
                while self.bytes_written < (512 << 20):
                    await response.write(chunk)
                    self.bytes_written += len(chunk)
            except (ConnectionResetError, aiohttp.ClientConnectionResetError, RuntimeError):
                pass
            return response
        tampered = {
            "oov": lambda r: msgspec.structs.replace(r, first_token_id=100_000),
            "negative": lambda r: msgspec.structs.replace(r, first_token_id=-5),
            "sent_blocks": lambda r: msgspec.structs.replace(r, num_sent_blocks=r.num_sent_blocks + 3),
            "cached_tokens": lambda r: msgspec.structs.replace(r, num_cached_tokens=10**6),
            "logprob": lambda r: msgspec.structs.replace(r, first_logprob=TokenLogprob(r.first_token_id, 5.0, [])),
            # Asked with prompt_logprobs=1 (``SCORING_MODES``): an entry for another token, one entry short,
            # a rank of 0; and (asked without) entries where none were asked for.
            "scored_token": lambda r: msgspec.structs.replace(r, prompt_logprobs=[
                TokenLogprob(e.token_id + 1, e.logprob, e.top, e.rank) for e in r.prompt_logprobs]),
            "scored_rank": lambda r: msgspec.structs.replace(r, prompt_logprobs=[
                msgspec.structs.replace(e, rank=0) for e in r.prompt_logprobs]),
            "scored_count": lambda r: msgspec.structs.replace(r, prompt_logprobs=r.prompt_logprobs[:-1]),
            "unasked": lambda r: msgspec.structs.replace(r, prompt_logprobs=[TokenLogprob(1, -1.0, [])]),
        }[self.mode](genuine)
        return web.Response(body=encode(tampered), content_type="application/msgpack")


MODES = ["oov", "negative", "sent_blocks", "cached_tokens", "logprob", "endless", "scored_token", "scored_count",
         "scored_rank", "unasked"]
SCORING_MODES = {"scored_token", "scored_count", "scored_rank"}  # asked with prompt_logprobs


@pytest.mark.parametrize("mode", MODES)
async def test_a_bad_prefill_answer_is_rejected_and_the_decode_worker_keeps_serving(cluster, reference, mode,
                                                                                     redis_client):
    seed = MODES.index(mode)
    evil = await EvilPrefill(cluster, mode).start(redis_client)
    try:
        prompt = prompt_ids(seed)
        frames = await generate(cluster, prompt, 8, prefill_worker_id=evil.worker_id,
                                prompt_logprobs=1 if mode in SCORING_MODES else None)
        assert evil.calls == 1
        assert not any(f.error for f in frames), frames
        # The answer is rejected: the decode worker computed the prompt itself, correctly.
        assert frames[0].prefill_fallback, f"the decode worker accepted a {mode} answer"
        assert tokens(frames) == reference(prompt, 8)
        if mode == "endless":
            assert evil.bytes_written < (64 << 20), "the decode worker read an unbounded answer"
    finally:
        await evil.stop()
    # It keeps serving: through the genuine prefill worker (no fallback) and on its own.
    other = prompt_ids(seed + 100)
    frames = await generate(cluster, other, 6, prefill_worker_id="p0")
    assert tokens(frames) == reference(other, 6) and not frames[0].prefill_fallback, frames
    assert frames[0].prefill_worker == "p0"
    stats = cluster.worker_json("d0", "/stats?check=1")
    assert stats["pool_ok"], stats["pool_error"]


async def test_a_genuine_answer_with_logprobs_passes_the_checks(cluster, reference):
    prompt = prompt_ids(60)
    frames = await generate(cluster, prompt, 3, prefill_worker_id="p0", logprobs=2)
    assert not frames[0].prefill_fallback and frames[0].prefill_worker == "p0"
    assert tokens(frames) == reference(prompt, 3)
    first = frames[0].logprobs[0]
    assert first.token_id == frames[0].token_ids[0] and len(first.top) == 2
    # Scoring the prompt: its entries come through the checks, and with the first frame.
    frames = await generate(cluster, prompt, 3, prefill_worker_id="p0", prompt_logprobs=2)
    assert not frames[0].prefill_fallback and frames[0].prefill_worker == "p0"
    assert [e.token_id for e in frames[0].prompt_logprobs] == prompt[1:]
    assert all(len(e.top) == 2 and e.logprob <= 0 and e.rank >= 1 for e in frames[0].prompt_logprobs)
    assert all(f.prompt_logprobs is None for f in frames[1:])


async def test_a_prefill_worker_not_in_the_registry_is_never_called(cluster, reference):
    honeypot = Honeypot()
    try:
        prompt = prompt_ids(50)
        for unknown in ("nobody", "127.0.0.1:%d" % honeypot.port):
            frames = await generate(cluster, prompt, 4, prefill_worker_id=unknown.replace(":", "-"))
            assert tokens(frames) == reference(prompt, 4) and frames[0].prefill_fallback
        assert honeypot.received == []
    finally:
        honeypot.close()
    # A caller-chosen URL is not even a valid request any more.
    status, answer = post_signed(cluster, "d0", "/generate", msgspec.msgpack.encode({
        "request_id": "ssrf", "prompt_token_ids": prompt, "sampling_params": {"max_tokens": 2},
        "prefill_url": f"http://127.0.0.1:{honeypot.port}"}))
    assert status == 400 and b"prefill_url" in answer


# ---- PrefillRequest fields -------------------------------------------------------------------


def post_signed(cluster, worker: str, path: str, body: bytes) -> tuple[int, bytes]:
    import urllib.request

    audience = cluster.worker_audience(worker)
    headers = ClusterAuth(cluster.cluster_secret).sign_request("POST", path, body, audience=audience)
    req = urllib.request.Request(cluster.worker_url(worker) + path, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


PREFILL_PROMPT = list(range(3, 44))  # 41 tokens = 11 blocks of 4


def prefill_body(**changes) -> dict:
    body = {"request_id": f"bad-{uuid.uuid4().hex[:8]}", "prompt_token_ids": PREFILL_PROMPT,
            "sampling_params": {"max_tokens": 4, "temperature": 0.0}, "decode_worker_id": "d0",
            "dst_block_ids": list(range(11)), "num_skip_blocks": 0, "transfer_id": uuid.uuid4().hex}
    body.update(changes)
    return body


@pytest.mark.parametrize("changes, needle", [
    ({"dst_block_ids": [-1] + list(range(1, 11))}, "dst_block_ids"),
    ({"num_skip_blocks": -1}, "num_skip_blocks"),
    ({"num_skip_blocks": 11, "dst_block_ids": []}, "num_skip_blocks"),
    ({"num_skip_blocks": 2}, "dst_block_ids: 11 ids for 9 blocks"),
    ({"dst_block_ids": list(range(10))}, "dst_block_ids: 10 ids for 11 blocks"),
    ({"dst_block_ids": [0] * 11}, "appears twice"),
    ({"dst_block_ids": list(range(250, 261))}, "the decode worker's pool"),
    ({"prompt_token_ids": PREFILL_PROMPT[:-1] + [512]}, "outside the vocabulary"),
    ({"prompt_token_ids": []}, "prompt"),
    # A moved stream's KV covers its resumed outputs too: 41 + 4 tokens are 12 blocks.
    ({"resume_token_ids": [5, 6, 7, 512]}, "resume_token_ids: token id 512 is outside the vocabulary"),
    ({"resume_token_ids": [5, 6, 7, 8]}, "dst_block_ids: 11 ids for 12 blocks"),
    ({"resume_token_ids": [5, 6, 7, 8], "moved_stream_id": ""}, "moved_stream_id"),
    ({"decode_worker_id": "nobody"}, "decode_worker_id 'nobody'"),
    ({"decode_worker_id": "http://10.0.0.1:1"}, "decode_worker_id"),
    ({"transfer_id": "guessable"}, "transfer_id"),
    ({"kv_address": {"transport": "tcp", "host": "10.6.6.6", "port": 1}}, "kv_address"),
    ({"sampling_params": {"temperature": -1.0}}, "temperature"),
    ({"sampling_params": {"top_p": 0.0}}, "top_p"),
])
def test_bad_prefill_requests_are_refused_with_a_clear_error(cluster, changes, needle):
    before = cluster.stats("p0")
    status, answer = post_signed(cluster, "p0", "/prefill", msgspec.msgpack.encode(prefill_body(**changes)))
    assert status == 400
    error = decode(answer, PrefillResult).error
    assert needle in error, error
    after = cluster.stats("p0")
    for key in ("inflight", "num_running", "num_waiting", "num_free_blocks", "prefill_computed_tokens", "kv_sent_bytes"):
        assert after[key] == before[key], key


# ---- the gateway's admin calls to a worker: signed for it, and the admin token stays home -------


class AdminRecorder:
    """A worker registered with the cluster secret (state idle: nothing is routed to it) that
    records what the gateway's admin proxy sends it."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.worker_id = "admin-recorder"
        self.received: list[tuple[str, str, dict, bytes]] = []  # method, path, headers, body
        self.refusals: dict[str, tuple[int, bytes]] = {}  # path -> the status and body it answers instead
        self.stalls: dict[str, asyncio.Event] = {}  # path -> what it waits for before it answers

    async def start(self, redis_client) -> "AdminRecorder":
        async def record(request: web.Request) -> web.Response:
            self.received.append((request.method, request.raw_path, dict(request.headers), await request.read()))
            if request.path in self.stalls:  # (a stopped process: it answers when it is resumed)
                await self.stalls[request.path].wait()
            if request.path in self.refusals:
                status, body = self.refusals[request.path]
                return web.Response(status=status, body=body, content_type="application/json")
            return web.json_response({"worker_id": self.worker_id, "role": "prefill", "state": "draining"})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", record)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        entry = msgspec.structs.replace(forged_entry(self.worker_id, "prefill", self.cluster.model_name, port),
                                        state="idle")
        self.instance = entry.instance  # the run the gateway signs its calls for
        self.registry = WorkerRegistry(redis_client, key_prefix=self.cluster.key_prefix, ttl_s=120,
                                       auth=ClusterAuth(self.cluster.cluster_secret))
        await self.registry.register(entry)
        return self

    async def stop(self) -> None:
        await self.registry.deregister(self.cluster.model_name, self.worker_id)
        await self.runner.cleanup()


async def test_admin_calls_reach_a_worker_signed_for_it_without_the_admin_token(cluster, redis_client):
    import asyncio

    recorder = await AdminRecorder(cluster).start(redis_client)
    try:
        for path, body in [("/admin/workers/admin-recorder/drain", b"{}"),
                           ("/admin/workers/admin-recorder/role", b'{"role": "decode"}'),
                           ("/admin/workers/admin-recorder/steps?limit=3", None)]:
            await asyncio.to_thread(http_json, f"{cluster.gateway_url}{path}", "GET" if body is None else "POST",
                                    body, {"X-Admin-Token": ADMIN_TOKEN, "Content-Type": "application/json"})
    finally:
        await recorder.stop()
    assert [(m, p) for m, p, _, _ in recorder.received] == [
        ("POST", "/admin/drain"), ("POST", "/admin/role"), ("GET", "/admin/steps?limit=3")]
    for _, path, headers, _ in recorder.received:
        assert not any(ADMIN_TOKEN in value for value in headers.values()), f"{path}: the admin token left the gateway"
        assert "X-Admin-Token" not in headers
    verifier = ClusterAuth(cluster.cluster_secret).request_verifier(recorder.worker_id, recorder.instance)
    for method, path, headers, body in recorder.received:
        assert headers["X-PD-Audience"] == f"{recorder.worker_id}/{recorder.instance}"
        verifier.verify_request(method, path, headers, body)  # signed for this worker, once each
    # ... and what the gateway sent one worker is no use on another, nor twice.
    method, path, headers, body = recorder.received[0]
    import urllib.request

    req = urllib.request.Request(cluster.worker_url("p0") + path, data=body, method=method, headers=headers)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 401
    assert cluster.stats("p0")["state"] == "active"


async def test_an_admin_call_a_worker_leaves_unanswered_is_a_504_that_says_it_may_still_take_effect(cluster,
                                                                                                    redis_client):
    """A worker that does not answer within the control timeout (stopped, say, and resumed later) may
    still carry the call out: the operator is told so, not that it failed (it said "did not answer: "
    with no reason, a 503)."""
    recorder = await AdminRecorder(cluster).start(redis_client)
    resumed = recorder.stalls["/admin/drain"] = asyncio.Event()
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            await asyncio.to_thread(http_json, f"{cluster.gateway_url}/admin/workers/admin-recorder/drain", "POST",
                                    b"{}", {"X-Admin-Token": ADMIN_TOKEN, "Content-Type": "application/json"})
    finally:
        resumed.set()
        await recorder.stop()
    error = json.loads(err.value.read())["error"]
    assert err.value.code == 504 and error["type"] == "timeout_error", error
    assert error["message"].startswith("worker admin-recorder did not answer within "), error
    assert "may still take effect" in error["message"], error


@pytest.mark.parametrize("status, body, relayed, says", [
    (400, b'{"error": "expected ?since=<unix time>"}', 400, "answered 400: expected ?since=<unix time>"),
    (409, b"not json", 409, "answered 409: not json"),
    # a worker refusing the gateway's signature is the gateway's setup, not the operator's token
    (401, b'{"error": "bad signature"}', 502, "answered 401: bad signature"),
    (500, b'{"error": {"nested": 1}}', 502, 'answered 500: {"error": {"nested": 1}}')])
async def test_a_workers_refusal_reaches_the_operator_in_the_apis_error_shape(cluster, redis_client, status, body,
                                                                            relayed, says):
    import asyncio

    recorder = await AdminRecorder(cluster).start(redis_client)
    recorder.refusals["/admin/steps"] = (status, body)
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            await asyncio.to_thread(http_json, f"{cluster.gateway_url}/admin/workers/admin-recorder/steps", "GET",
                                    None, {"X-Admin-Token": ADMIN_TOKEN})
    finally:
        await recorder.stop()
    error = json.loads(err.value.read())["error"]
    assert err.value.code == relayed and error["message"] == f"worker admin-recorder {says}", error
