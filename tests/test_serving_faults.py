"""Failure behaviour of the served system: Redis loss, a prefill or decode worker killed."""
from __future__ import annotations

import socket
import time
import urllib.request

import openai
import pytest

from common.cluster.redis_util import RedisServer
from tests.cluster import http_json, running_cluster
from tests.test_serving import WORKER_ARGS, wait_idle

PROMPT = "The quick brown fox jumps over the lazy dog, and then"


@pytest.fixture(scope="module")
def private_redis():
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stack(served_checkpoint, private_redis, tmp_path_factory):
    with running_cluster(served_checkpoint, tmp_path_factory.mktemp("logs"), private_redis.url, prefill=2, decode=2,
                         worker_args=WORKER_ARGS, gateway_args=["--skip-prefill-below", "8"]) as c:
        yield c


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none", max_retries=0)


def complete(stack, prompt=PROMPT, max_tokens=8):
    return client(stack).completions.create(model=stack.model_name, prompt=prompt, temperature=0,
                                            max_tokens=max_tokens, extra_body={"ignore_eos": True})


def metric(stack, name: str, labels: str = "") -> float:
    """The gateway's value of ``name`` (summed over label sets containing ``labels``)."""
    total = 0.0
    with urllib.request.urlopen(f"{stack.gateway_url}/metrics") as resp:
        for line in resp.read().decode().splitlines():
            if (line.startswith(name + " ") or line.startswith(name + "{")) and labels in line:
                total += float(line.split()[-1])
    return total


def kill_keeping_port(server: RedisServer) -> socket.socket:
    """SIGKILL Redis and hold its port (bound, not listening: clients are refused, as by a dead
    Redis) so no other process on this shared machine takes it before the restart."""
    server.kill()
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", server.port))
    return holder


def test_redis_loss_falls_back_to_load_then_refills(stack, private_redis):
    import redis

    baseline = complete(stack).choices[0].text
    port = int(private_redis.url.rsplit(":", 1)[1])
    holder = kill_keeping_port(private_redis)
    # Serving goes on while Redis is down: routing on the last known pool and its load.
    for _ in range(3):
        assert complete(stack).choices[0].text == baseline
    assert metric(stack, "pdserve_redis_unavailable_total") > 0
    assert http_json(f"{stack.gateway_url}/health")["redis"] is False
    # Redis comes back empty on the same port: workers re-register and republish their caches.
    holder.close()
    restarted = RedisServer(port=port).start()
    private_redis.proc = restarted.proc  # the module fixture stops whichever process runs now
    stack.wait_for_workers(prefill=2, decode=2, timeout=30)
    client_ = redis.Redis.from_url(restarted.url)
    deadline = time.monotonic() + 20
    while not any(client_.scard(k) for k in client_.scan_iter(match=f"{stack.key_prefix}:*:blocks:*")):
        assert time.monotonic() < deadline, "prefix index did not refill after Redis came back"
        time.sleep(0.1)
    client_.close()
    assert complete(stack).choices[0].text == baseline


def test_prefill_worker_killed_request_is_computed_elsewhere(stack):
    baseline = complete(stack, max_tokens=6).choices[0].text
    fallbacks_before = sum(stack.stats(d)["remote_prefill_fallbacks"] for d in ("d0", "d1"))
    direct_before = metric(stack, "pdserve_prefill_skipped_total", "no active prefill worker")
    stack.kill("p0")
    stack.kill("p1")
    # Until their heartbeats lapse the gateway still routes to the dead prefill workers; the
    # decode worker then computes the prompt itself, so nothing was streamed and nothing is lost.
    # (Fresh prompts: a prompt the decode worker already caches would skip the prefill pool.)
    results = [complete(stack, prompt=f"Number {i}: streaming tokens to many clients", max_tokens=6) for i in range(3)]
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6 for r in results)
    # Each request either reached a dead prefill worker and was computed by the decode worker
    # instead, or (once the gateway saw the heartbeats lapse) went straight to a decode worker.
    fallbacks = sum(stack.stats(d)["remote_prefill_fallbacks"] for d in ("d0", "d1")) - fallbacks_before
    direct = metric(stack, "pdserve_prefill_skipped_total", "no active prefill worker") - direct_before
    assert fallbacks + direct == 3 and fallbacks >= 1
    # Once the heartbeats lapse the gateway stops routing to them.
    health = stack.wait_for_workers(prefill=0, decode=2, timeout=20)
    assert health["workers"]["prefill"] == 0
    assert complete(stack, max_tokens=6).choices[0].text == baseline
    for name in ("p0", "p1"):
        stack.start_worker(name, "prefill")
    stack.wait_for_workers(prefill=2, decode=2, timeout=60)


def test_decode_worker_killed_mid_stream_gives_an_error_event(stack):
    c = client(stack)
    stream = c.completions.create(model=stack.model_name, prompt=PROMPT, stream=True, temperature=0,
                                  max_tokens=1000, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    serving = [d for d in ("d0", "d1") if stack.stats(d)["num_running"] == 1]
    assert len(serving) == 1
    stack.kill(serving[0])
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        for _ in chunks:
            pass
    # The other decode worker keeps serving, and the dead one leaves the pool.
    survivor = "d1" if serving[0] == "d0" else "d0"
    assert complete(stack).choices[0].finish_reason == "length"
    stack.wait_for_workers(prefill=2, decode=1, timeout=20)
    for _ in range(3):
        assert complete(stack).choices[0].finish_reason == "length"
    wait_idle(stack, survivor)
