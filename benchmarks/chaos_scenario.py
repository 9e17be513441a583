"""The chaos scenario: a real stack under disconnects, crashes, a Redis restart and hostile input.

``tests/test_chaos.py`` runs it briefly in ``make test``; ``benchmarks/chaos.py --minutes N`` runs
it longer.  Both call ``run_chaos(ChaosConfig(...), workdir)`` and judge the dict it returns.

    stack     gateway + 2 prefill + 2 decode workers (real processes, ``LocalStack``), a private
              redis-server, KV over TCP or UCX, a tiny random Llama (tests/checkpoints.py), KV
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
    judged    every request ends within ``request_bound_s`` with a complete answer or an explicit
              error (an HTTP status, or an error event in the stream); every greedy answer (and
              every greedy partial answer) equals the offline engine's output for its prompt, in
              fp32 on the same checkpoint; afterwards every worker passes the block-pool integrity
              check with every block free (only cached blocks), holds nothing in flight, is
              registered and healthy; the gateway has nothing in flight; idle workers use ~no CPU.

The returned dict has ``requests``, ``completed``, ``explicit_errors``, ``disconnected``, ``hangs``,
``broken`` (ended without an answer or an explicit error, or with a wrong-length answer),
``parity_checked``, ``parity_mismatches``, ``leaked_blocks``, ``workers_healthy_at_end`` and details.
"""
from __future__ import annotations

import asyncio
import json
import math
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
from dataclasses import dataclass, field
from pathlib import Path

import openai
import psutil

from common.cluster.launcher import LocalStack, Supervisor, gateway_health, http_json
from common.cluster.redis_util import RedisServer

ADMIN_TOKEN = "chaos-admin-token"
T0 = time.monotonic()  # event and outcome times are relative to this
MAX_MODEL_LEN = 1600


@dataclass(frozen=True)
class ChaosConfig:
    """One chaos run.  ``requests`` per round; rounds repeat until ``minutes`` have passed (0: one round)."""

    transport: str = "tcp"
    requests: int = 300
    minutes: float = 0.0
    concurrency: int = 12
    seed: int = 0
    min_prompt: int = 8
    max_prompt: int = 1500
    max_tokens: int = 24
    faults: tuple[str, ...] = ("hostile", "kill_prefill", "kill_decode", "restart_redis", "garbage_kv")
    request_bound_s: float = 120.0  # a request that has not ended by then is a hang
    block_size: int = 16
    decode_blocks: int = 112  # 1792 tokens: one long prompt nearly fills a decode worker
    prefill_blocks: int = 112
    settle_timeout_s: float = 120.0  # for the stack to be back to idle after the load
    idle_cpu_window_s: float = 5.0


# ---- the checkpoint and the offline reference ---------------------------------------------------


def write_checkpoint(directory: Path) -> Path:
    """The tiny random Llama of tests/checkpoints.py, long enough for 1500-token prompts."""
    from tests.checkpoints import tiny_llama_config, write_checkpoint as write, write_tokenizer

    if not (directory / "config.json").exists():
        write(tiny_llama_config(max_position_embeddings=2048), directory)
        write_tokenizer(directory)
    return directory


def reference_texts(checkpoint: Path, items: list[tuple[tuple[int, ...], int]]) -> dict:
    """``{(prompt_ids, max_tokens): text}``: the offline engine's greedy output in fp32, as the
    gateway would stream it (its detokenizer over the generated ids, prompt as context)."""
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine
    from gateway.detokenizer import StreamingDecoder

    items = sorted(set(items))
    if not items:
        return {}
    engine = Engine(EngineConfig(model=str(checkpoint), dtype="float32", device="cpu", block_size=16,
                                 num_blocks=2048, max_model_len=MAX_MODEL_LEN))
    ids: dict[str, list[int]] = {}
    keys: dict[str, tuple] = {}
    for prompt, max_tokens in items:
        rid = engine.add_request(list(prompt), {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        ids[rid], keys[rid] = [], (prompt, max_tokens)
    while engine.has_unfinished():
        for out in engine.step():
            ids[out.request_id].extend(out.new_token_ids)
    texts = {}
    for rid, token_ids in ids.items():
        decoder = StreamingDecoder(engine.tokenizer, keys[rid][0])
        texts[keys[rid]] = decoder.step(token_ids) + decoder.finish()
    return texts


# ---- the requests ------------------------------------------------------------------------------


@dataclass
class Spec:
    """One planned request."""

    index: int
    prompt: list[int]
    max_tokens: int
    temperature: float
    stream: bool
    top_p: float = 1.0
    seed: int | None = None
    extra: dict = field(default_factory=dict)  # hostile fields (huge top_k)
    disconnect: str | None = None  # "before_first" | "during_transfer" | "mid_decode"
    cancel_after_s: float | None = None
    after_chunks: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def kind(self) -> str:
        if self.temperature and self.greedy:
            return "tiny_temperature"
        if self.extra:
            return "huge_top_k"
        return ("greedy" if self.greedy else "sampled") + ("_stream" if self.stream else "")


@dataclass
class Outcome:
    spec: Spec
    kind: str  # completed | error | disconnected | hang | broken
    text: str = ""
    detail: str = ""
    status: int | None = None
    seconds: float = 0.0
    ended_at: float = field(default_factory=time.monotonic)


class Planner:
    """Random request specs from a seed: a mix of lengths, modes and planned disconnects."""

    def __init__(self, config: ChaosConfig, vocab: int):
        self.config = config
        self.rng = random.Random(config.seed)
        self.vocab = vocab
        self.count = 0
        # Long shared prefixes: prefix-cache hits on both pools, so only the missing blocks move.
        self.prefixes = [self._ids(self.rng.randint(64, 600)) for _ in range(4)]

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def _length(self) -> int:
        c = self.config
        return int(round(math.exp(self.rng.uniform(math.log(c.min_prompt), math.log(c.max_prompt)))))

    def next(self) -> Spec:
        rng, c = self.rng, self.config
        n = self._length()
        if rng.random() < 0.35:
            prefix = rng.choice(self.prefixes)
            prompt = (prefix + self._ids(max(1, n - len(prefix))))[: max(n, len(prefix) + 1)]
        else:
            prompt = self._ids(n)
        prompt = prompt[: c.max_prompt]
        spec = Spec(self.count, prompt, max_tokens=rng.randint(1, c.max_tokens), temperature=0.0,
                    stream=rng.random() < 0.5)
        self.count += 1
        roll = rng.random()
        if roll < 0.35:
            spec.temperature, spec.top_p = rng.uniform(0.6, 1.3), rng.choice([1.0, 0.9])
            spec.seed = rng.choice([None, rng.randrange(1 << 30)])
        elif roll < 0.38:
            spec.temperature = 1e-40  # hostile: must mean greedy, not inf/NaN logits
        elif roll < 0.41:
            spec.temperature, spec.extra = 0.8, {"top_k": 2 ** 70}  # hostile: bounded by the vocabulary
        roll = rng.random()
        if roll < 0.05:
            spec.disconnect, spec.cancel_after_s = "before_first", rng.uniform(0.0, 0.05)
        elif roll < 0.10 and len(prompt) >= 300:
            spec.disconnect, spec.cancel_after_s = "during_transfer", rng.uniform(0.05, 1.0)
        elif roll < 0.15 and spec.max_tokens >= 4:
            spec.disconnect, spec.stream = "mid_decode", True
            spec.after_chunks = rng.randint(1, spec.max_tokens - 2)
        return spec


async def run_request(client: openai.AsyncOpenAI, model: str, spec: Spec, bound_s: float) -> Outcome:
    """Send one request as a client would; classify how it ended."""
    kwargs = dict(model=model, prompt=spec.prompt, max_tokens=spec.max_tokens, temperature=spec.temperature,
                  top_p=spec.top_p, stream=spec.stream, extra_body={"ignore_eos": True, **spec.extra})
    if spec.seed is not None:
        kwargs["seed"] = spec.seed
    if spec.stream:
        kwargs["stream_options"] = {"include_usage": True}
    pieces: list[str] = []
    began = time.monotonic()

    def outcome(kind: str, **kw) -> Outcome:
        return Outcome(spec, kind, text="".join(pieces), seconds=time.monotonic() - began, **kw)

    async def send() -> Outcome:
        if not spec.stream:
            r = await client.completions.create(**kwargs)
            pieces.append(r.choices[0].text)
            return judge_complete(r.choices[0].finish_reason, r.usage.completion_tokens)
        stream = await client.completions.create(**kwargs)
        finish, tokens, chunks = None, None, 0
        try:
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                if not chunk.choices:
                    continue
                pieces.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
                chunks += 1
                if spec.disconnect == "mid_decode" and chunks >= spec.after_chunks and finish is None:
                    return outcome("disconnected", detail="mid_decode")
        finally:
            await stream.close()
        return judge_complete(finish, tokens)

    def judge_complete(finish, tokens) -> Outcome:
        if finish == "length" and tokens == spec.max_tokens:
            return outcome("completed")
        return outcome("broken", detail=f"ended with finish_reason={finish}, {tokens} tokens of {spec.max_tokens}")

    task = asyncio.ensure_future(send())
    try:
        if spec.cancel_after_s is not None:
            done, _ = await asyncio.wait({task}, timeout=spec.cancel_after_s)
            if not done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return outcome("disconnected", detail=spec.disconnect)
        async with asyncio.timeout(max(0.0, bound_s - (time.monotonic() - began))):
            return await asyncio.shield(task)
    except TimeoutError:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return outcome("hang", detail=f"no end within {bound_s:g} s")
    except openai.APIStatusError as exc:
        return outcome("error", status=exc.status_code, detail=str(exc.message)[:300])
    except openai.APIConnectionError as exc:
        return outcome("broken", detail=f"connection lost without an error: {exc!r}"[:300])
    except openai.APIError as exc:  # an error event in a started stream
        return outcome("error", detail=str(exc.message)[:300])
    except Exception as exc:  # noqa: BLE001 - anything else is a broken answer, reported
        return outcome("broken", detail=f"{type(exc).__name__}: {exc}"[:300])


# ---- the stack and its faults ------------------------------------------------------------------


class ChaosStack:
    """The stack, its private Redis and a supervisor thread that restarts whatever dies."""

    def __init__(self, config: ChaosConfig, checkpoint: Path, workdir: Path):
        self.config = config
        self.redis = RedisServer().start()
        self.events: list[str] = []
        c = config
        common = ["--heartbeat-ttl", "2", "--block-size", str(c.block_size),
                  "--max-num-batched-tokens", "256", "--max-num-seqs", "16", "--max-model-len", str(MAX_MODEL_LEN),
                  "--kv-timeout", "30", "--kv-lease-timeout", "10", "--kv-abort-grace", "2", "--dtype", "float32"]
        self.stack = LocalStack(
            str(checkpoint), self.redis.url, key_prefix=f"chaos-{uuid.uuid4().hex[:8]}", workdir=workdir,
            prefill=2, decode=2, transport=c.transport, worker_args=common,
            role_args={"decode": ["--num-blocks", str(c.decode_blocks)],
                       "prefill": ["--num-blocks", str(c.prefill_blocks)]},
            gateway_args=["--admin-token", ADMIN_TOKEN, "--skip-prefill-below", "32", "--max-inflight", "64",
                          "--bench-time", "2", "--queue-timeout", "15", "--first-token-timeout", "60",
                          "--upstream-idle-timeout", "30", "--max-model-len", str(MAX_MODEL_LEN)],
            extra_env={"OMP_NUM_THREADS": "1"})
        self._stop = threading.Event()
        self.supervisor = Supervisor(self.stack, min_backoff=0.5, max_backoff=4.0, say=self._say)
        self._thread = threading.Thread(target=self.supervisor.run, args=(self._stop.is_set,), daemon=True)
        self.hostile_results: list[dict] = []
        self._recovering: set[asyncio.Task] = set()
        self.longest_stall_s: dict[str, float] = {}

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
        """SIGKILL a decode worker while it streams (the one with the most running requests)."""
        deadline = time.monotonic() + 10
        best, running = f"d{round_no % 2}", 0
        while time.monotonic() < deadline:
            for name in ("d0", "d1"):
                try:
                    n = (await asyncio.to_thread(self.stack.stats, name))["num_running"]
                except (OSError, ValueError, KeyError):
                    continue
                if n > running:
                    best, running = name, n
            if running:
                break
            await asyncio.sleep(0.1)
        await self.kill(best, f"a decode worker crashes with {running} requests running")

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


# ---- after the load: is everything back? -------------------------------------------------------


def worker_problems(stats: dict) -> list[str]:
    """What is still held by a worker that should be idle (empty when all is well)."""
    problems = []
    for key in ("inflight", "num_unfinished", "num_running", "num_waiting", "num_waiting_for_remote_kv",
                "kv_transfers_settling", "kv_incoming", "kv_outgoing"):
        if stats.get(key):
            problems.append(f"{key}={stats[key]}")
    if stats.get("num_free_blocks") != stats.get("num_blocks"):
        problems.append(f"{stats['num_blocks'] - stats['num_free_blocks']} blocks held")
    if stats.get("pool_ok") is not True:
        problems.append(f"block pool integrity: {stats.get('pool_error')}")
    return problems


def gateway_metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


async def settle(chaos: ChaosStack) -> dict:
    """Wait (bounded) for the stack to be idle and whole again; report what is not."""
    c = chaos.config
    deadline = time.monotonic() + c.settle_timeout_s
    while True:
        report = await asyncio.to_thread(_snapshot, chaos)
        if report["workers_healthy_at_end"] or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    # Idle: every worker's CPU time over a few seconds of no traffic.
    procs = {name: psutil.Process(chaos.pid(name)) for name in chaos.workers}
    before = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
    await asyncio.sleep(c.idle_cpu_window_s)
    report["idle_cpu_s"] = {name: round(sum(p.cpu_times()[:2]) - before[name], 3) for name, p in procs.items()}
    report["idle_cpu_window_s"] = c.idle_cpu_window_s
    report["settle_s"] = round(c.settle_timeout_s - max(0.0, deadline - time.monotonic()), 1)
    return report


def _snapshot(chaos: ChaosStack) -> dict:
    stack = chaos.stack
    problems: dict[str, list[str]] = {}
    leaked = 0
    for name in chaos.workers:
        try:
            stats = stack.worker_json(name, "/stats?check=1")
            http_json(f"{stack.procs[name].url}/health", timeout=5)
        except (OSError, ValueError) as exc:
            problems[name] = [f"unreachable or unhealthy: {exc}"]
            continue
        leaked += stats["num_blocks"] - stats["num_free_blocks"]
        if found := worker_problems(stats):
            problems[name] = found
    try:
        health = gateway_health(stack.gateway_url)
        pools = http_json(f"{stack.gateway_url}/admin/pools", headers={"X-Admin-Token": ADMIN_TOKEN})
        inflight = gateway_metric(stack.gateway_url, "pdserve_requests_in_flight")
        queued = gateway_metric(stack.gateway_url, "pdserve_requests_queued")
    except (OSError, ValueError) as exc:
        problems["gateway"] = [f"unreachable: {exc}"]
        health, pools, inflight, queued = {}, {"workers": []}, None, None
    registered = {w["worker_id"]: (w["role"], w["state"]) for w in pools["workers"]}
    want = {"p0": ("prefill", "active"), "p1": ("prefill", "active"), "d0": ("decode", "active"),
            "d1": ("decode", "active")}
    if registered != want:
        problems.setdefault("registry", []).append(f"registered {registered}")
    if health.get("status") != "ok" or health.get("pools") != {"decode": {"healthy": 2, "benched": 0},
                                                               "prefill": {"healthy": 2, "benched": 0}}:
        problems.setdefault("gateway", []).append(f"health {health}")
    if inflight or queued:
        problems.setdefault("gateway", []).append(f"in flight {inflight}, queued {queued}")
    return {"workers_healthy_at_end": not problems, "problems": problems, "leaked_blocks": leaked,
            "gateway_inflight": inflight}


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
            round_no += 1
            chaos.event(f"round {round_no} done: {len(outcomes)} requests")
            if time.monotonic() >= end:
                return outcomes
    finally:
        await client.close()


def run_chaos(config: ChaosConfig, workdir: Path, checkpoint: Path | None = None) -> dict:
    """Start the stack, run the scenario, check the aftermath, stop everything; the results."""
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = write_checkpoint(checkpoint or workdir / "tinyllama")
    began = time.monotonic()
    chaos = ChaosStack(config, checkpoint, workdir)
    try:
        chaos.start()
        chaos.event("stack up")
        load_began = time.monotonic()
        outcomes = asyncio.run(_drive(chaos, config))
        load_s = time.monotonic() - load_began
        aftermath = asyncio.run(settle(chaos))
        preemptions = gateway_metric(chaos.stack.gateway_url, "pdserve_preemptions_total")
        busy = gateway_metric(chaos.stack.gateway_url, "pdserve_decode_busy_total")
        fallbacks = gateway_metric(chaos.stack.gateway_url, "pdserve_kv_transfer_failures_total")
    finally:
        chaos.stop()
    parity = check_parity(checkpoint, outcomes)
    kinds = Counter(o.kind for o in outcomes)
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
        "by_prompt_len": {bucket: dict(Counter(o.kind for o in outcomes if _bucket(len(o.spec.prompt)) == bucket))
                          for bucket in ("<256", "256-1023", ">=1024")},
        "preemptions": preemptions,
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
            "stream": s.stream, "disconnect": s.disconnect, "status": o.status, "detail": o.detail,
            "seconds": round(o.seconds, 2), "ended_at": round(o.ended_at - T0, 2)}


def check_parity(checkpoint: Path, outcomes: list[Outcome]) -> dict:
    """Greedy answers (and greedy partial answers) against the offline engine's output."""
    greedy = [o for o in outcomes if o.spec.greedy and (o.kind == "completed" or o.text)]
    refs = reference_texts(checkpoint, [(tuple(o.spec.prompt), o.spec.max_tokens) for o in greedy])
    mismatches = []
    for o in greedy:
        ref = refs[(tuple(o.spec.prompt), o.spec.max_tokens)]
        ok = o.text == ref if o.kind == "completed" else ref.startswith(o.text)
        if not ok:
            mismatches.append({**_describe(o), "outcome": o.kind, "got": o.text[:80], "want": ref[:80]})
    return {"parity_checked": len(greedy), "parity_complete": sum(o.kind == "completed" for o in greedy),
            "parity_mismatches": len(mismatches), "mismatch_examples": mismatches[:5]}


def summary(result: dict) -> dict:
    """The headline numbers (what the benchmark prints last)."""
    keys = ("transport", "requests", "completed", "explicit_errors", "disconnected", "hangs", "broken",
            "parity_checked", "parity_mismatches", "leaked_blocks", "workers_healthy_at_end", "preemptions",
            "decode_busy_answers", "remote_prefill_fallbacks", "restarts", "longest_stall_s", "load_s", "total_s")
    out = {k: result[k] for k in keys}
    out["idle_cpu_s_max"] = max(result["idle_cpu_s"].values(), default=None)
    out["hostile_ok"] = all(h["ok"] for h in result["hostile"])
    return out


__all__ = ["ChaosConfig", "run_chaos", "summary", "write_checkpoint"]
