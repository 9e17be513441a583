"""The chaos scenario: a real stack under disconnects, crashes, a Redis restart and hostile input.

``tests/serving/test_chaos.py`` runs it briefly in ``make test``; ``benchmarks/chaos.py --minutes N`` runs
it longer.  Both call ``run_chaos(ChaosConfig(...), workdir)`` and judge the dict it returns.

    stack     gateway + 2 prefill + 2 decode workers (real processes, ``LocalStack``), a private
              redis-server, KV over TCP or UCX, a tiny random Llama (tests/support/checkpoints.py), KV
              pools small enough that reservations contend and requests get preempted; a
              ``Supervisor`` (the launcher's) restarts whatever dies
    load      ``concurrency`` clients of the official ``openai`` package; each request greedy or
              sampled, streamed or not, prompt 8..1500 tokens (some share long prefixes, so
              prefix-cache hits and partial KV shipping happen), ``ignore_eos`` so every
              complete answer has exactly ``max_tokens`` tokens; some clients leave on purpose
              (before the first token, while a long prompt's KV moves, mid-decode)
    faults    per round of ``requests`` requests, at fixed fractions of it: hostile HTTP input
              and garbage on every KV port, a prefill worker SIGKILLed, a decode worker SIGKILLed
              while it streams, Redis killed and restarted on its port, garbage on the KV ports
              again (the restarted workers' too)
    judged    (``benchmarks/chaos_checks.py``) every request ends within ``request_bound_s`` with a
              complete answer or an explicit error (an HTTP status, or an error event in the
              stream) that a fault explains (a stream cut by its decode worker's SIGKILL, 503 or
              429 with Retry-After); every greedy answer (and every greedy partial answer) equals
              the offline engine's output for its prompt, in fp32 on the same checkpoint;
              afterwards -- checked before any lease of the run could have ended, so nothing that
              only a lease would free looks clean -- every worker passes the block-pool integrity
              check with every block free (only cached blocks), holds nothing in flight, is
              registered and healthy; the gateway has nothing in flight; idle workers use ~no CPU.

The returned dict has ``requests``, ``completed``, ``explicit_errors``, ``disconnected``, ``hangs``,
``broken`` (ended without an answer or an explicit error, or with a wrong-length answer),
``unexplained_errors``, ``error_classes``, ``parity_checked``, ``parity_mismatches``,
``leaked_blocks``, ``leak_check_before_leases_end``, ``workers_healthy_at_end`` and details.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import openai

from benchmarks.chaos_checks import (classify_error, gateway_metric, migrations_so_far, reference_texts, settle,
                                     streams_moved, summary)
from benchmarks.chaos_requests import ChaosConfig, Outcome, Planner, Spec, run_request
from launcher.local_stack import LocalStack, http_json
from launcher.supervisor import Supervisor
from common.cluster.children import start_child
from common.cluster.redis_util import RedisServer

ADMIN_TOKEN = "pdserve-chaos-admin-token"  # the gateway's (in its environment: never on a command line)
T0 = time.monotonic()  # event and outcome times are relative to this
MAX_MODEL_LEN = 1600
# The witness streams of ``kill_decode``: long enough to outlive the kill (400 tokens could all have
# left between the reading of ``streams_open`` and the SIGKILL on a faster engine: 0 migrations, once).
WITNESS_INDEX, WITNESS_TOKENS = 1_000_000, 1200
WITNESS_STREAMING_CHUNKS = 2  # chunks its client has read before its worker may be killed
WITNESS_ATTEMPTS, WITNESS_READINGS = 3, 20  # witnesses for one kill, at most; readings of the workers' streams each
MIGRATION_WAIT_S = 30.0  # at most, for the gateway to move the killed worker's streams


# ---- the checkpoint and the offline reference ---------------------------------------------------


def write_checkpoint(directory: Path) -> Path:
    """The tiny random Llama of tests/support/checkpoints.py, long enough for 1500-token prompts."""
    from tests.support.checkpoints import tiny_llama_config, write_checkpoint as write, write_tokenizer

    if not (directory / "config.json").exists():
        write(tiny_llama_config(max_position_embeddings=2048), directory)
        write_tokenizer(directory)
    return directory


# ---- the stack and its faults ------------------------------------------------------------------


class ChaosStack:
    """The stack, its private Redis and a supervisor thread that restarts whatever dies."""

    def __init__(self, config: ChaosConfig, checkpoint: Path, workdir: Path, spawner=start_child):
        self.config = config
        self.redis = RedisServer().start()
        self.events: list[str] = []
        c = config
        backstop = str(c.kv_backstop_s)  # no lease ends before the leak check (ChaosConfig.kv_backstop_s)
        common = ["--heartbeat-ttl", "2", "--block-size", str(c.block_size),
                  "--max-num-batched-tokens", "256", "--max-num-seqs", "16", "--max-model-len", str(MAX_MODEL_LEN),
                  "--kv-timeout", backstop, "--kv-lease-timeout", backstop, "--kv-abort-grace", "2",
                  "--dtype", "float32"]
        self.stack = LocalStack(
            str(checkpoint), self.redis.url, key_prefix=f"chaos-{uuid.uuid4().hex[:8]}", workdir=workdir,
            prefill=2, decode=2, transport=c.transport, worker_args=common,
            role_args={"decode": ["--num-blocks", str(c.decode_blocks)],
                       "prefill": ["--num-blocks", str(c.prefill_blocks)]},
            # A first token later than a request's bound is a hang the client reports, not a retry
            # elsewhere after a timeout that would hide what the worker still holds.
            gateway_args=["--skip-prefill-below", "32", "--max-inflight", "64",
                          "--bench-time", "2", "--queue-timeout", "15",
                          "--first-token-timeout", str(c.request_bound_s + 30),
                          "--upstream-idle-timeout", "30", "--max-model-len", str(MAX_MODEL_LEN)],
            extra_env={"OMP_NUM_THREADS": "1", "PDSERVE_ADMIN_TOKEN": ADMIN_TOKEN}, spawner=spawner)
        self.admin_token = ADMIN_TOKEN
        self._stop = threading.Event()
        self.supervisor = Supervisor(self.stack, min_backoff=0.5, max_backoff=4.0, say=self._say)
        self._thread = threading.Thread(target=self.supervisor.run, args=(self._stop.is_set,), daemon=True)
        self.hostile_results: list[dict] = []
        self._recovering: set[asyncio.Task] = set()
        self.longest_stall_s: dict[str, float] = {}
        self.kills: list[tuple[str, float]] = []  # (name, time.monotonic()) of every SIGKILL
        self.witnesses: list[asyncio.Task] = []  # long streams a decode worker's SIGKILL cuts (``kill_decode``)

    def _say(self, message: str, **_) -> None:
        self.event(message)

    def event(self, message: str) -> None:
        self.events.append(f"{time.monotonic() - T0:7.2f}s {message}")

    def start(self) -> "ChaosStack":
        self.stack.start(timeout=300)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self.stack.stop()
        self.redis.stop()

    @property
    def workers(self) -> list[str]:
        return [n for n in self.stack.procs if n != "gateway"]

    def pid(self, name: str) -> int:
        return self.stack.procs[name].popen.pid

    # ---- faults --------------------------------------------------------------------------

    async def kill(self, name: str, why: str) -> None:
        """SIGKILL ``name``; the supervisor starts it again (``recovered()`` waits until it serves)."""
        proc = self.stack.procs[name]
        old = proc.popen
        os.kill(old.pid, signal.SIGKILL)
        self.kills.append((name, time.monotonic()))
        self.event(f"SIGKILL {name} ({why})")
        task = asyncio.ensure_future(self._back(name, old))
        self._recovering.add(task)

    async def _back(self, name: str, old) -> None:
        proc = self.stack.procs[name]
        began = time.monotonic()
        while proc.popen is old or not await asyncio.to_thread(self._healthy, name):
            if time.monotonic() - began > 180:
                self.event(f"{name} did not come back within 180 s")
                return
            await asyncio.sleep(0.2)
        self.event(f"{name} serves again")

    async def watch_stalls(self, interval: float = 2.0) -> None:
        """Sample the decode workers: the longest time each had work waiting and nothing running
        (a scheduler that cannot make progress), reported as ``longest_stall_s``."""
        since: dict[str, float] = {}
        while True:
            for name in ("d0", "d1"):
                try:
                    stats = await asyncio.to_thread(self.stack.stats, name)
                except (OSError, ValueError):
                    since.pop(name, None)
                    continue
                now = time.monotonic()
                if stats["num_running"] == 0 and stats["num_waiting"] > 0:
                    began = since.setdefault(name, now)
                    self.longest_stall_s[name] = max(self.longest_stall_s.get(name, 0.0), round(now - began, 1))
                else:
                    since.pop(name, None)
            await asyncio.sleep(interval)

    async def recovered(self) -> None:
        """Wait for every killed process to serve again."""
        if self._recovering:
            await asyncio.gather(*self._recovering)
            self._recovering.clear()

    def _healthy(self, name: str) -> bool:
        try:
            http_json(f"{self.stack.procs[name].url}/health", timeout=2)
            return True
        except (OSError, ValueError):
            return False

    async def kill_prefill(self, round_no: int) -> None:
        await self.kill(f"p{round_no % 2}", "a prefill worker crashes")

    async def kill_decode(self, round_no: int) -> None:
        """SIGKILL a decode worker mid-stream, so the gateway has streams to move: a witness (a
        long greedy stream, judged like every request) is started first.  Once its client has
        received tokens (so it streams from a decode worker: a request still waiting in the gateway's
        queue, or one whose first token the gateway has not read yet, would not be moved but sent
        again), the worker killed is the one with streams open (``streams_open``) while the other
        has none -- the witness's -- or, failing such a reading within ``WITNESS_READINGS``, the
        one with the most; a witness that ended first (it moves nothing) is followed by another."""
        for attempt in range(WITNESS_ATTEMPTS):
            witness, best, serving = await self._decode_worker_to_kill(round_no, attempt)
            if not witness.done():
                break
            self.event("the witness ended before its decode worker was chosen; another one")
        moved = await asyncio.to_thread(migrations_so_far, self.stack.gateway_url)
        await self.kill(best, f"a decode worker crashes with {serving} streams open")
        # The next fault (Redis) waits until the gateway has moved the cut streams, or the witness
        # ended: with the registry down at that moment it finds no decode worker to move them to.
        if await streams_moved(self.stack.gateway_url, moved, witness, MIGRATION_WAIT_S):
            self.event("the gateway moved the cut streams")

    async def _decode_worker_to_kill(self, round_no: int, attempt: int) -> tuple[asyncio.Task, str, int]:
        """A witness started, the decode worker to kill and its streams open (``kill_decode``)."""
        spec = Spec(WITNESS_INDEX + WITNESS_ATTEMPTS * round_no + attempt, list(range(5, 21)), WITNESS_TOKENS,
                    temperature=0.0, stream=True)
        received, readings = [0], 0
        witness = asyncio.ensure_future(self._witness(spec, lambda: received.__setitem__(0, received[0] + 1)))
        self.witnesses.append(witness)
        best, serving = f"d{round_no % 2}", 0
        while not witness.done():
            if received[0] < WITNESS_STREAMING_CHUNKS:
                await asyncio.sleep(0.05)
                continue
            counts = {}
            for name in ("d0", "d1"):
                try:
                    counts[name] = (await asyncio.to_thread(self.stack.stats, name))["streams_open"]
                except (OSError, ValueError, KeyError):
                    continue
            serving_now = {name: n for name, n in counts.items() if n}
            if serving_now and max(serving_now.values()) >= serving:
                best, serving = max(serving_now.items(), key=lambda item: item[1])
            if len(counts) == 2 and len(serving_now) == 1:
                best, serving = next(iter(serving_now.items()))
                break
            readings += 1
            if readings >= WITNESS_READINGS and serving:
                break
            await asyncio.sleep(0.05)
        return witness, best, serving

    async def _witness(self, spec: Spec, on_chunk) -> Outcome:
        client = openai.AsyncOpenAI(base_url=f"{self.stack.gateway_url}/v1", api_key="none", max_retries=0,
                                    timeout=self.config.request_bound_s + 30)
        try:
            return await run_request(client, self.stack.model_name, spec, self.config.request_bound_s, on_chunk)
        finally:
            await client.close()

    async def restart_redis(self, _round_no: int) -> None:
        """Kill Redis, hold its port (refused, as by a dead Redis) for a moment, start it again empty."""
        self.redis.kill()
        holder = socket.socket()
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", self.redis.port))
        self.event("Redis killed")
        await asyncio.sleep(2.0)
        holder.close()
        await asyncio.to_thread(self.redis.start)
        self.event("Redis restarted (empty)")

    async def hostile(self, round_no: int) -> None:
        """Oversized and large bodies at the gateway, then garbage on every KV port."""
        url = f"{self.stack.gateway_url}/v1/completions"
        model = self.stack.model_name
        checks = [
            ("oversized body", b'{"model": "m", "prompt": "' + b"x" * (5 << 20) + b'"}', (413,)),
            # ~300 kB of valid JSON is read whole (not truncated): refused for its length, not as bad JSON.
            ("300 kB body", json.dumps({"model": model, "prompt": "hello " * 50_000, "max_tokens": 4}).encode(),
             (400,)),
            ("garbage JSON", bytes(random.Random(round_no).randrange(256) for _ in range(2048)), (400,)),
        ]
        for what, body, allowed in checks:
            status, message = await asyncio.to_thread(_post, url, body)
            ok = status in allowed and "not valid JSON" not in message if what == "300 kB body" else status in allowed
            self.hostile_results.append({"what": what, "status": status, "ok": ok, "message": message[:200]})
            self.event(f"hostile {what}: {status}")
        await self.garbage_kv(round_no)

    async def garbage_kv(self, round_no: int) -> None:
        """Random bytes, then a frame header claiming a huge length, on every live worker's KV port
        (read from the worker itself: the registry may be empty right after a Redis restart)."""
        rng = random.Random(1000 + round_no)
        sprayed = []
        for name in self.workers:
            try:
                status = await asyncio.to_thread(self.stack.worker_json, name, "/admin/status")  # signed for it
            except (OSError, ValueError):
                continue  # down (being restarted)
            kv = status["kv_address"]
            for payload in (bytes(rng.randrange(256) for _ in range(4096)), b"\xff" * 16 + (2 ** 62).to_bytes(8, "big")):
                await asyncio.to_thread(_spray, kv["host"], kv["port"], payload)
            sprayed.append(name)
        self.event(f"garbage on the KV ports of {', '.join(sprayed)}")


def _post(url: str, body: bytes) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, f"{type(exc).__name__}: {exc}"


def _spray(host: str, port: int | None, payload: bytes) -> None:
    if not port:
        return
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(payload)
            s.settimeout(0.5)
            try:
                s.recv(65536)
            except OSError:
                pass
    except OSError:
        pass  # the worker may hang up at once: that is fine


# ---- the run -----------------------------------------------------------------------------------


async def _drive(chaos: ChaosStack, config: ChaosConfig) -> list[Outcome]:
    stack = chaos.stack
    planner = Planner(config, vocab=512)
    outcomes: list[Outcome] = []
    started = time.monotonic()
    end = started + config.minutes * 60
    client = openai.AsyncOpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none", max_retries=0,
                                timeout=config.request_bound_s + 30)
    faults = {"hostile": chaos.hostile, "kill_prefill": chaos.kill_prefill, "kill_decode": chaos.kill_decode,
              "restart_redis": chaos.restart_redis, "garbage_kv": chaos.garbage_kv}
    schedule = [(f, name) for f, name in ((0.1, "hostile"), (0.2, "kill_prefill"), (0.4, "kill_decode"),
                                          (0.6, "restart_redis"), (0.75, "garbage_kv")) if name in config.faults]
    round_no = 0
    try:
        while True:
            planned = [planner.next() for _ in range(config.requests)]
            queue = iter(planned)
            started_in_round = 0
            load_done = False

            async def clients():
                nonlocal started_in_round
                for spec in queue:
                    if config.minutes and time.monotonic() >= end:
                        return  # time is up: no new requests (those in flight finish)
                    started_in_round += 1
                    outcomes.append(await run_request(client, stack.model_name, spec, config.request_bound_s))

            async def injector():
                for fraction, name in schedule:
                    while started_in_round < fraction * config.requests:
                        if load_done:
                            return
                        await asyncio.sleep(0.05)
                    await faults[name](round_no)

            monitor = asyncio.ensure_future(chaos.watch_stalls())
            faulting = asyncio.ensure_future(injector())
            try:
                await asyncio.gather(*(clients() for _ in range(config.concurrency)))
                load_done = True
                await faulting  # a fault under way completes (Redis is never left down)
            finally:
                monitor.cancel()
                faulting.cancel()
            await chaos.recovered()
            outcomes.extend(await asyncio.gather(*chaos.witnesses))
            chaos.witnesses.clear()
            round_no += 1
            chaos.event(f"round {round_no} done: {len(outcomes)} requests")
            if time.monotonic() >= end:
                return outcomes
    finally:
        for witness in chaos.witnesses:
            witness.cancel()
        await client.close()


def run_chaos(config: ChaosConfig, workdir: Path, checkpoint: Path | None = None, spawner=start_child) -> dict:
    """Start the stack, run the scenario, check the aftermath, stop everything; the results.
    ``spawner`` starts its processes (``LocalStack.spawner``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = write_checkpoint(checkpoint or workdir / "tinyllama")
    began = time.monotonic()
    chaos = ChaosStack(config, checkpoint, workdir, spawner)
    try:
        chaos.start()
        chaos.event("stack up")
        load_began = time.monotonic()
        outcomes = asyncio.run(_drive(chaos, config))
        load_s = time.monotonic() - load_began
        # No reservation or pin of the run can have a lease ending before this (none began before the load).
        leases_end_at = load_began + config.kv_backstop_s
        aftermath = asyncio.run(settle(chaos, config.settle_timeout_s, leases_end_at, config.idle_cpu_window_s))
        upstream_timeouts = gateway_metric(chaos.stack.gateway_url, "pdserve_upstream_timeouts_total")
        preemptions = gateway_metric(chaos.stack.gateway_url, "pdserve_preemptions_total")
        busy = gateway_metric(chaos.stack.gateway_url, "pdserve_decode_busy_total")
        migrations = gateway_metric(chaos.stack.gateway_url, "pdserve_migrations_total")
        fallbacks = gateway_metric(chaos.stack.gateway_url, "pdserve_kv_transfer_failures_total")
    finally:
        chaos.stop()
    parity = check_parity(checkpoint, outcomes)
    kinds = Counter(o.kind for o in outcomes)
    errors = [(o, classify_error(o, chaos.kills)) for o in outcomes if o.kind == "error"]
    result = {
        "transport": config.transport,
        "requests": len(outcomes),
        "completed": kinds["completed"],
        "explicit_errors": kinds["error"],
        "disconnected": kinds["disconnected"],
        "hangs": kinds["hang"],
        "broken": kinds["broken"],
        **parity,
        "leaked_blocks": aftermath["leaked_blocks"],
        "leak_check_before_leases_end": aftermath["leak_check_before_leases_end"],
        "settle_s": aftermath["settle_s"],
        "workers_healthy_at_end": aftermath["workers_healthy_at_end"],
        "problems_at_end": aftermath["problems"],
        "gateway_inflight_at_end": aftermath["gateway_inflight"],
        "idle_cpu_s": aftermath["idle_cpu_s"],
        "idle_cpu_window_s": aftermath["idle_cpu_window_s"],
        "hostile": chaos.hostile_results,
        "by_kind": {k: dict(Counter(o.kind for o in outcomes if o.spec.kind == k))
                    for k in sorted({o.spec.kind for o in outcomes})},
        "disconnects": dict(Counter(o.spec.disconnect for o in outcomes if o.spec.disconnect)),
        "error_statuses": dict(Counter(str(o.status) for o in outcomes if o.kind == "error")),
        "error_reasons": dict(Counter(_reason(o.detail) for o in outcomes if o.kind == "error")),
        # Every explicit error is explained by a fault (chaos_checks.ERROR_CLASSES) or listed here.
        "error_classes": dict(Counter(kind for _, kind in errors if kind)),
        "unexplained_errors": [_describe(o) for o, kind in errors if kind is None],
        "upstream_timeouts": upstream_timeouts,
        "by_prompt_len": {bucket: dict(Counter(o.kind for o in outcomes if _bucket(len(o.spec.prompt)) == bucket))
                          for bucket in ("<256", "256-1023", ">=1024")},
        "preemptions": preemptions,
        "migrations": migrations,  # streams that moved to another decode worker (gateway.migration)
        "decode_busy_answers": busy,
        "remote_prefill_fallbacks": fallbacks,
        "restarts": dict(chaos.supervisor.restarts),
        "longest_stall_s": chaos.longest_stall_s,
        "load_s": round(load_s, 1),
        "total_s": round(time.monotonic() - began, 1),
        "events": chaos.events,
        "examples": {kind: [_describe(o) for o in outcomes if o.kind == kind][:5]
                     for kind in ("hang", "broken", "error")},
        "mismatch_examples": parity.pop("mismatch_examples"),
    }
    return result


def _bucket(prompt_len: int) -> str:
    return "<256" if prompt_len < 256 else "256-1023" if prompt_len < 1024 else ">=1024"


def _reason(detail: str) -> str:
    """An error message without the parts that vary (numbers, worker names' digits included)."""
    return re.sub(r"\d+(\.\d+)?", "N", detail.removeprefix("Error code: "))[:120]


def _describe(o: Outcome) -> dict:
    s = o.spec
    return {"index": s.index, "kind": s.kind, "prompt_len": len(s.prompt), "max_tokens": s.max_tokens,
            "stream": s.stream, "disconnect": s.disconnect, "status": o.status, "retry_after": o.retry_after,
            "detail": o.detail,
            "seconds": round(o.seconds, 2), "ended_at": round(o.ended_at - T0, 2)}


def check_parity(checkpoint: Path, outcomes: list[Outcome]) -> dict:
    """Greedy answers (and greedy partial answers) against the offline engine's output."""
    greedy = [o for o in outcomes if o.spec.greedy and (o.kind == "completed" or o.text)]
    refs = reference_texts(checkpoint, [(tuple(o.spec.prompt), o.spec.max_tokens) for o in greedy], MAX_MODEL_LEN)
    mismatches = []
    for o in greedy:
        ref = refs[(tuple(o.spec.prompt), o.spec.max_tokens)]
        ok = o.text == ref if o.kind == "completed" else ref.startswith(o.text)
        if not ok:
            mismatches.append({**_describe(o), "outcome": o.kind, "got": o.text[:80], "want": ref[:80]})
    return {"parity_checked": len(greedy), "parity_complete": sum(o.kind == "completed" for o in greedy),
            "parity_mismatches": len(mismatches), "mismatch_examples": mismatches[:5]}


__all__ = ["ChaosConfig", "run_chaos", "summary", "write_checkpoint"]
