"""Failure behaviour of the served system: Redis loss, a prefill or decode worker killed.

The tests share one stack (a private Redis, one prefill and two decode workers, a gateway).  Each
holds the condition it needs instead of racing a heartbeat: a killed worker's registry entry is
kept alive while the test needs the gateway to route to it (``HeldEntries``), the serving worker
is found by what it reports in flight, and every wait is for a condition, with a bound that only
turns a hang into a failure.  Whatever a test breaks is repaired after it, pass or fail
(``whole_stack``), so a failure never spills into the next test.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from common.cluster.redis_util import RedisServer
from launcher.local_stack import gateway_health
from tests.support.cluster import (
    ADMIN_TOKEN, HeldEntries, extra_gateway, extra_worker, gateway_metric as metric, http_json, running_cluster,
)
from tests.support.serving import BLOCK_SIZE, WORKER_ARGS, wait_idle
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow(seconds=125)  # a long file: scheduled by its length (tests/conftest.py)

PROMPT = "The quick brown fox jumps over the lazy dog, and then"
POOL = {"prefill": 1, "decode": 2}
DECODERS = ("d0", "d1")
# A drain with this many streams on one decode worker, each long enough to be decoding still when
# the drain lands after the last one started (the KV pools hold them all on either worker).
# (A step's token budget above STREAMS: all of them decode in every step.)
STREAMS, STREAM_TOKENS = 20, 600  # long enough that no stream ends before the drain (3 s at least)
# Added to every engine step: a tiny model's step takes a millisecond or two, so a stream of 800
# tokens could end before a drain command's Python process starts (or between two drains waiting on
# heartbeats); with this it lasts seconds at least, however fast the steps get.
STEP_DELAY_S = 0.005  # (a wait, not work: a long stream costs the machine little)
STACK_ARGS = ["--num-blocks", "4200", "--max-num-batched-tokens", "32"]  # (blocks of BLOCK_SIZE tokens)
# Bounds on waits for a condition that must come (a process start, a registry entry lapsing, a
# worker going idle): generous, since 2 shared cores may be busy with other work.
WAIT_S = 300.0


@pytest.fixture(scope="module")
def private_redis():
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stack(served_checkpoint, private_redis, tmp_path_factory):
    with running_cluster(served_checkpoint, tmp_path_factory.mktemp("logs"), private_redis.url, **POOL,
                         worker_args=[*WORKER_ARGS, *STACK_ARGS], gateway_args=["--skip-prefill-below", "8"],
                         extra_env={"PDSERVE_TEST_STEP_DELAY_S": str(STEP_DELAY_S)}) as c:
        yield c


@pytest.fixture(autouse=True)
def whole_stack(stack, private_redis):
    """Before a test: the stack is whole (every process serving, the gateway routing to all of
    them, nobody benched, every worker idle).  After it, pass or fail: whatever it stopped is
    started again (the next test, or the module's teardown, waits for it)."""
    wait_whole(stack)
    yield
    if private_redis.proc is None or private_redis.proc.poll() is not None:
        private_redis.start(timeout_s=60)  # empty: the workers re-register at their next heartbeat
    for name, proc in stack.procs.items():
        if not proc.alive:
            stack.restart(name)


def wait_whole(stack) -> None:
    for name in stack.procs:
        if name != "gateway":
            wait_active(stack, name)
    deadline = time.monotonic() + WAIT_S
    while True:
        health = stack.wait_for_workers(**POOL, timeout=WAIT_S)
        if all(pool["benched"] == 0 for pool in health["pools"].values()):
            break
        assert time.monotonic() < deadline, f"workers still benched: {health}"
        time.sleep(0.2)
    for name in stack.procs:
        if name != "gateway":
            wait_idle(stack, name, timeout=WAIT_S)


def wait_active(stack, name: str) -> None:
    """Until the worker process ``name`` itself answers, active (loaded, registered)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        assert stack.procs[name].alive, f"{name} stopped:\n{stack.procs[name].log()}"
        try:
            if stack.stats(name)["state"] == "active":
                return
        except (OSError, ValueError):
            pass
        assert time.monotonic() < deadline, f"{name} not active after {WAIT_S:g} s:\n{stack.procs[name].log()}"
        time.sleep(0.2)


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none", max_retries=0)


def complete(stack, prompt=PROMPT, max_tokens=8):
    return client(stack).completions.create(model=stack.model_name, prompt=prompt, temperature=0,
                                            max_tokens=max_tokens, extra_body={"ignore_eos": True})


def fallbacks(stack) -> int:
    """Prompts the decode workers computed themselves after their remote prefill failed."""
    return sum(stack.stats(d)["remote_prefill_fallbacks"] for d in DECODERS)


def skipped_for_no_prefill_worker(stack) -> float:
    return metric(stack, "pdserve_prefill_skipped_total", "no active prefill worker")


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
    holder = kill_keeping_port(private_redis)
    try:
        # The gateway notices (its pool refresh fails) ...
        wait_until(lambda: http_json(f"{stack.gateway_url}/health")["redis"] is False, "the gateway seeing Redis down")
        assert metric(stack, "pdserve_redis_unavailable_total") > 0
        # ... and serving goes on while Redis is down: routing on the last known pool and its load.
        for _ in range(3):
            assert complete(stack).choices[0].text == baseline
    finally:
        holder.close()
    # Redis comes back empty on the same port: workers re-register and republish their caches.
    private_redis.start(timeout_s=60)
    stack.wait_for_workers(**POOL, timeout=WAIT_S)
    client_ = redis.Redis.from_url(private_redis.url)
    try:
        wait_until(lambda: any(client_.scard(k) for k in client_.scan_iter(match=f"{stack.key_prefix}:*:blocks:*")),
                   "the prefix index refilling after Redis came back")
    finally:
        client_.close()
    assert complete(stack).choices[0].text == baseline


def test_prefill_worker_killed_request_is_computed_elsewhere(stack):
    baseline = complete(stack, max_tokens=6).choices[0].text
    fallbacks_before, direct_before = fallbacks(stack), skipped_for_no_prefill_worker(stack)
    held = HeldEntries.capture(stack, ["p0"])
    stack.kill("p0")
    with held.kept():
        # Until its entry lapses the gateway routes prompts to the dead prefill worker: held here,
        # so every request below goes there.  The decode worker cannot reach it and computes the
        # prompt itself; nothing was streamed yet, so nothing is lost.  (Fresh prompts: one the
        # decode worker already caches would skip the prefill pool.)
        stack.wait_for_workers(**POOL, timeout=WAIT_S)
        results = [complete(stack, prompt=f"{word} streaming tokens to many clients, request {i}", max_tokens=6)
                   for i, word in enumerate(("Alpha", "Bravo", "Charlie"))]
        assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6 for r in results)
        assert fallbacks(stack) - fallbacks_before == 3
        assert skipped_for_no_prefill_worker(stack) == direct_before
    # Once its entry lapses (as when its heartbeats stop) the gateway stops routing to it: a fresh
    # prompt goes straight to a decode worker, no remote prefill tried.
    health = stack.wait_for_workers(prefill=0, decode=POOL["decode"], timeout=WAIT_S)
    assert health["workers"]["prefill"] == 0
    direct = complete(stack, prompt="Delta streaming tokens to many clients, request 3", max_tokens=6)
    assert direct.usage.completion_tokens == 6
    assert skipped_for_no_prefill_worker(stack) == direct_before + 1
    assert fallbacks(stack) - fallbacks_before == 3
    assert complete(stack, max_tokens=6).choices[0].text == baseline


def serving_decode_worker(stack, decoders=DECODERS) -> str:
    """The one decode worker that reports a request in flight (the caller has one stream open)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        serving = [d for d in decoders if stack.procs[d].alive and stack.stats(d)["inflight"] > 0]
        if serving:
            assert len(serving) == 1, f"more than one decode worker busy: {serving}"
            return serving[0]
        assert time.monotonic() < deadline, "no decode worker reports the open stream"
        time.sleep(0.05)


def open_stream(base_url: str, model: str, prompt: str, max_tokens: int, **params):
    """A streamed completion with its first chunk read (the request holds a decode worker)."""
    stream = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0).completions.create(
        model=model, prompt=prompt, stream=True, max_tokens=max_tokens, extra_body={"ignore_eos": True}, **params)
    chunks = iter(stream)
    first = next(chunks)
    return first.choices[0].text, chunks


def rest_of(first: str, chunks) -> str:
    return first + "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)


def seeded_answer_and_stream(stack, prompt: str, max_tokens: int, seed: int | None):
    """The whole answer of a seeded sampled request (``seed`` None: a greedy one), then the same
    request streamed, its first chunk read: ``(whole, first, chunks)``."""
    params = dict(temperature=0.0) if seed is None else dict(temperature=0.8, top_p=0.95, seed=seed)
    whole = client(stack).completions.create(model=stack.model_name, prompt=prompt, max_tokens=max_tokens,
                                             extra_body={"ignore_eos": True}, **params).choices[0].text
    return (whole, *open_stream(stack.gateway_url, stack.model_name, prompt, max_tokens, **params))


def test_a_stream_whose_decode_worker_dies_moves_to_the_other_and_goes_on_unbroken(stack):
    # Seeded sampling: the worker the stream moves to draws what the dead one would have drawn.
    moves_before = metric(stack, "pdserve_migrations_total", 'cause="worker_lost"')
    whole, first, chunks = seeded_answer_and_stream(stack, "A stream that outlives its decode worker:", STREAM_TOKENS, 23)
    serving = serving_decode_worker(stack)
    stack.kill(serving)
    assert rest_of(first, chunks) == whole  # no break, no duplicate, no lost token
    assert metric(stack, "pdserve_migrations_total", 'cause="worker_lost"') == moves_before + 1
    assert metric(stack, "pdserve_migrated_tokens_total") > 0
    survivor = next(d for d in DECODERS if d != serving)
    wait_idle(stack, survivor, timeout=WAIT_S)


def test_a_messages_api_stream_outlives_its_decode_worker(stack):
    """Anthropic's Messages API streams through the same move: its decode worker dies, the stream goes
    on at the other one, and the client's stream helper rebuilds the message the unmoved request gave."""
    import anthropic

    messages = anthropic.Anthropic(base_url=stack.gateway_url, api_key="none", max_retries=0, timeout=WAIT_S)
    params = dict(model=stack.model_name, max_tokens=400, messages=[{"role": "user", "content": "A moved message:"}],
                  extra_body={"ignore_eos": True, "temperature": 0.8, "seed": 29})
    whole = messages.messages.create(**params)
    moves_before = metric(stack, "pdserve_migrations_total", 'cause="worker_lost"')
    with messages.messages.stream(**params) as stream:
        events = iter(stream)
        while next(events).type != "content_block_delta":  # a token is out: the request holds a decode worker
            pass
        stack.kill(serving_decode_worker(stack))
        for _ in events:
            pass
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 400)
    assert metric(stack, "pdserve_migrations_total", 'cause="worker_lost"') == moves_before + 1


def test_a_greedy_stream_replayed_twice_equals_the_unmoved_answer(stack):
    """Under one stream its decode worker dies, then the next one too: each time the stream is
    computed again at another (a third decode worker joins for this) and goes on unbroken."""
    prompt = "A stream that outlives two decode workers:"
    whole = complete(stack, prompt=prompt, max_tokens=500).choices[0].text
    moves_before = metric(stack, "pdserve_migrations_total", 'cause="worker_lost"')
    gaps_before = metric(stack, "pdserve_migration_gap_seconds_count")
    with extra_worker(stack, "d2", "decode"):
        first, chunks = open_stream(stack.gateway_url, stack.model_name, prompt, 500, temperature=0)
        stack.kill(serving_decode_worker(stack, (*DECODERS, "d2")))
        # Killed again only once tokens flow from where it moved (before that, a lost worker is
        # a retry of the move, not a second move): the gateway has timed the move's gap.
        wait_until(lambda: metric(stack, "pdserve_migration_gap_seconds_count") >= gaps_before + 1,
                   "the moved stream's first token from its new worker")
        stack.kill(serving_decode_worker(stack, (*DECODERS, "d2")))
        assert rest_of(first, chunks) == whole
        assert metric(stack, "pdserve_migrations_total", 'cause="worker_lost"') == moves_before + 2


def test_without_migration_a_dead_decode_worker_ends_its_stream_with_an_error(stack):
    with extra_gateway(stack, "gateway-no-migration", ["--migration-limit", "0"]) as gateway:
        first, chunks = open_stream(gateway.url, stack.model_name, PROMPT, 400, temperature=0)
        serving = serving_decode_worker(stack)
        stack.kill(serving)
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            rest_of(first, chunks)
    # The other decode worker keeps serving (a request the gateway still sends to the dead one is
    # retried there), and the dead one leaves the pool once its entry lapses.
    survivor = next(d for d in DECODERS if d != serving)
    assert complete(stack).choices[0].finish_reason == "length"
    stack.wait_for_workers(prefill=POOL["prefill"], decode=POOL["decode"] - 1, timeout=WAIT_S)
    for _ in range(3):
        assert complete(stack).choices[0].finish_reason == "length"
    wait_idle(stack, survivor, timeout=WAIT_S)


def test_without_migration_a_responses_stream_ends_failed_with_what_it_had(stack):
    """The Responses API's stream ends as that API's does: ``response.failed`` naming the failure,
    its text item closed incomplete, holding every delta sent."""
    with extra_gateway(stack, "gateway-no-migration-responses", ["--migration-limit", "0"]) as gateway:
        stream = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0).responses.create(
            model=stack.model_name, input=PROMPT, stream=True, max_output_tokens=400, temperature=0,
            extra_body={"ignore_eos": True})
        events = iter(stream)
        first = [next(events) for _ in range(5)]  # created, in_progress, the item and its part, a delta
        assert first[-1].type == "response.output_text.delta"
        stack.kill(serving_decode_worker(stack))
        rest = list(events)
    failed = rest[-1]
    assert failed.type == "response.failed" and "failed mid-stream" in failed.response.error.message
    assert rest[-2].type == "response.output_item.done" and rest[-2].item.status == "incomplete"
    text = "".join(e.delta for e in first + rest if e.type == "response.output_text.delta")
    assert failed.response.status == "failed" and failed.response.output[0].content[0].text == text
    assert [e.sequence_number for e in first + rest] == list(range(len(first) + len(rest)))


def drain_from_the_container(stack, worker: str, tmp_path) -> None:
    """What a Kubernetes preStop hook runs in the worker's container: ``entrypoint.py --drain``,
    with the container's runtime file and cluster secret."""
    runtime = tmp_path / "runtime.json"
    runtime.write_text(json.dumps({"worker_id": worker, "health_url": f"{stack.worker_url(worker)}/health"}))
    env = {**os.environ, "PDSERVE_RUNTIME_FILE": str(runtime), "PDSERVE_CLUSTER_SECRET": stack.cluster_secret}
    result = subprocess.run([sys.executable, str(ROOT / "compose" / "entrypoint.py"), "--drain", str(WAIT_S)],
                            env=env, capture_output=True, text=True, timeout=WAIT_S + 60)
    assert result.returncode == 0 and f"{worker} is idle" in result.stdout, result.stderr
    assert stack.cluster_secret not in result.stdout + result.stderr


def admin(stack, worker: str, action: str, body: bytes = b"{}") -> None:
    http_json(f"{stack.gateway_url}/admin/workers/{worker}/{action}", "POST", body, {"X-Admin-Token": ADMIN_TOKEN})


def decoders_routed(stack) -> int:
    """Decode workers the gateway routes to now (its /health answers 503 while it routes to none: a
    worker benched a moment on a loaded machine as another leaves the pool)."""
    return gateway_health(stack.gateway_url)["pools"]["decode"]["healthy"]


def open_streams_on(stack, drained: str, other: str, prompts: list[str]) -> list:
    """Greedy streams of ``prompts``, each with its first chunk read, all on ``drained``: ``other`` is
    out of the decode pool (a prefill worker) while they start."""
    admin(stack, other, "role", b'{"role": "prefill"}')
    wait_until(lambda: decoders_routed(stack) == 1, f"the gateway routing to {drained} alone")
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: open_stream(stack.gateway_url, stack.model_name, p, STREAM_TOKENS,
                                                   temperature=0), prompts))


def test_a_drain_hands_twenty_streams_over_and_each_goes_on_unbroken(stack):
    """Twenty streams on one decode worker (the other is out of the decode pool while they
    start); a drain through the gateway's admin API hands every one over at once -- none decodes
    to its end there -- and each goes on at the other worker as if it had never moved."""
    # Prompts too short for the prefill pool (--skip-prefill-below): all start on d0 within a few steps.
    prompts = [f"Stream {i}" for i in range(STREAMS)]
    with ThreadPoolExecutor(STREAMS) as pool:
        wholes = list(pool.map(lambda p: complete(stack, prompt=p, max_tokens=STREAM_TOKENS).choices[0].text,
                               prompts))
    drained, other = DECODERS
    handed_before = stack.stats(drained)["streams_handed_over"]
    moves_before = metric(stack, "pdserve_migrations_total", 'cause="drain"')
    precopies_before = metric(stack, "pdserve_migration_precopies_total", 'outcome="ok"')
    held_before = metric(stack, "pdserve_migration_held_tokens_total")
    before = {worker: stack.stats(worker) for worker in DECODERS}
    try:
        streams = open_streams_on(stack, drained, other, prompts)
        # Back in the registry before the drain (a role change is written at once): the gateway
        # reads it when the first stream is handed over.
        admin(stack, other, "role", b'{"role": "decode"}')
        admin(stack, drained, "drain")
        with ThreadPoolExecutor(STREAMS) as pool:
            assert list(pool.map(lambda stream: rest_of(*stream), streams)) == wholes
        wait_until(lambda: stack.stats(drained)["state"] == "idle", f"{drained} idle after its drain")
        assert stack.stats(drained)["streams_handed_over"] - handed_before == STREAMS
        assert metric(stack, "pdserve_migrations_total", 'cause="drain"') == moves_before + STREAMS
        # A live move: each stream's KV went from the drained worker's cache to the other one
        # (no fallback to computing it there), the drained worker computing only what its cache
        # lacked -- at most the last, partial block of each, once for the pre-copy and once for
        # the hand-over.  Every stream was pre-copied while it decoded on, so the worker it moved
        # to held all its KV but the tokens since (at least the prompt and a block of output each).
        after = {worker: stack.stats(worker) for worker in DECODERS}
        grew = {worker: {k: after[worker][k] - before[worker][k] for k in after[worker]
                         if isinstance(after[worker][k], (int, float))} for worker in DECODERS}
        assert grew[drained]["moved_blocks"] >= STREAMS, grew
        assert grew[other]["remote_prefill_fallbacks"] == 0, grew
        assert grew[drained]["prefill_computed_tokens"] <= 2 * STREAMS * BLOCK_SIZE, grew
        assert metric(stack, "pdserve_migration_precopies_total", 'outcome="ok"') == precopies_before + STREAMS
        assert metric(stack, "pdserve_migration_held_tokens_total") - held_before >= STREAMS * BLOCK_SIZE
    finally:
        for worker in DECODERS:
            admin(stack, worker, "role", b'{"role": "decode"}')


def test_draining_the_last_decode_worker_finishes_its_streams_there(stack):
    """With no other decode worker active (the other out of the pool: as when a stack that stops
    drains every one at once), a drain hands nothing over -- there is nowhere to go -- and each
    stream decodes to its end where it is."""
    prompts = [f"Last decoder {i}" for i in range(4)]  # (a few show it: the test above drains twenty)
    with ThreadPoolExecutor(len(prompts)) as pool:
        wholes = list(pool.map(lambda p: complete(stack, prompt=p, max_tokens=STREAM_TOKENS).choices[0].text,
                               prompts))
    drained, other = DECODERS
    handed_before = stack.stats(drained)["streams_handed_over"]
    told_before = [metric(stack, "pdserve_migration_precopies_total", f'outcome="{o}"') for o in ("ok", "failed")]
    try:
        streams = open_streams_on(stack, drained, other, prompts)
        admin(stack, drained, "drain")
        running = stack.stats(drained)["num_running"]  # (the drain landed while streams decode)
        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(lambda stream: rest_of(*stream), streams)) == wholes
        wait_until(lambda: stack.stats(drained)["state"] == "idle", f"{drained} idle after its drain")
        assert running > 0 and stack.stats(drained)["streams_handed_over"] == handed_before
        # None was even told it would move (no pre-copy tried: the drain waits on none).
        assert [metric(stack, "pdserve_migration_precopies_total", f'outcome="{o}"')
                for o in ("ok", "failed")] == told_before
    finally:
        for worker in DECODERS:
            admin(stack, worker, "role", b'{"role": "decode"}')


def test_streams_a_drain_handed_over_go_back_when_the_worker_they_went_to_dies(stack):
    """The double fault: d0 drains and hands its streams to d1, which is killed -- no active decode
    worker is left, so d0 (draining, alive, its cache holding them) takes them back and decodes each
    to its end, unbroken (they failed after the wait queue's bound, a live worker at hand)."""
    prompts = [f"Double fault {i}" for i in range(4)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        wholes = list(pool.map(lambda p: complete(stack, prompt=p, max_tokens=STREAM_TOKENS).choices[0].text,
                               prompts))
    drained, other = DECODERS
    handed_before = stack.stats(drained)["streams_handed_over"]
    lost_before = metric(stack, "pdserve_migrations_total", 'cause="worker_lost"')
    gaps_before = metric(stack, "pdserve_migration_gap_seconds_count")
    try:
        streams = open_streams_on(stack, drained, other, prompts)
        admin(stack, other, "role", b'{"role": "decode"}')
        admin(stack, drained, "drain")
        # Each stream streams from there (a first token after its move), so killing it loses them mid-stream.
        wait_until(lambda: metric(stack, "pdserve_migration_gap_seconds_count") - gaps_before == len(prompts),
                   f"every stream going on at {other}")
        assert stack.stats(drained)["streams_handed_over"] - handed_before == len(prompts)
        stack.kill(other)
        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(lambda stream: rest_of(*stream), streams)) == wholes
        assert metric(stack, "pdserve_migrations_total", 'cause="worker_lost"') == lost_before + len(prompts)
        wait_idle(stack, drained, timeout=WAIT_S)
    finally:
        admin(stack, drained, "role", b'{"role": "decode"}')


def test_a_drain_from_the_container_hands_its_streams_over(stack, tmp_path):
    """What a Kubernetes preStop hook runs: the streams move, then the drain command returns."""
    # Long streams: still decoding when the drain lands (the drain command is a new Python process).
    prompts = [f"Stream {i} of a decode worker drained from its container" for i in range(2)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        wholes = list(pool.map(lambda p: complete(stack, prompt=p, max_tokens=800).choices[0].text, prompts))
    streams = [open_stream(stack.gateway_url, stack.model_name, p, 800, temperature=0) for p in prompts]
    inflight = {d: stack.stats(d)["inflight"] for d in DECODERS}
    drained = max(DECODERS, key=inflight.get)
    handed_before = stack.stats(drained)["streams_handed_over"]
    moves_before = metric(stack, "pdserve_migrations_total", 'cause="drain"')
    try:
        drain_from_the_container(stack, drained, tmp_path)
        assert [rest_of(first, chunks) for first, chunks in streams] == wholes
        wait_until(lambda: stack.stats(drained)["state"] == "idle", f"{drained} idle after its drain")
        handed = stack.stats(drained)["streams_handed_over"] - handed_before
        assert handed >= 1  # its streams moved rather than decoding to the end there
        assert metric(stack, "pdserve_migrations_total", 'cause="drain"') == moves_before + handed
    finally:
        admin(stack, drained, "role", b'{"role": "decode"}')


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_one_stream_moved_live_twice_equals_the_unmoved_answer(stack, seed):
    # Two live moves (each drain ships the stream's KV to the other worker, which samples on at
    # the next output index): a greedy stream goes on as it would have, a seeded one draws what it
    # would have drawn unmoved.
    moves_before = metric(stack, "pdserve_migrations_total", 'cause="drain"')
    whole, first, chunks = seeded_answer_and_stream(stack, "One stream, drained away twice:", 800, seed)
    a = serving_decode_worker(stack)
    b = next(d for d in DECODERS if d != a)
    try:
        admin(stack, a, "drain")  # first move: a -> b (pre-copied, handed over, the tail fetched)
        wait_until(lambda: stack.stats(a)["state"] == "idle", f"{a} idle: the stream moved on to {b}")
        admin(stack, a, "role", b'{"role": "decode"}')  # a serves again ...
        wait_until(lambda: decoders_routed(stack) == 2, f"the gateway routing to {a} again")
        admin(stack, b, "drain")  # ... and takes the stream back: b -> a
        assert rest_of(first, chunks) == whole
        assert metric(stack, "pdserve_migrations_total", 'cause="drain"') == moves_before + 2
    finally:
        for worker in DECODERS:
            admin(stack, worker, "role", b'{"role": "decode"}')
