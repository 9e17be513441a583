"""How a chaos run is judged (``benchmarks/chaos_scenario.py`` runs it).

    errors    each explicit error a client got is explained by a fault, or it counts as
              unexplained: ``classify_error`` (a stream cut by the SIGKILL of the decode worker
              that served it, named in the error, while the request ran; 503 + Retry-After when
              no decode worker could take a request in time; 429 + Retry-After at the gateway's
              in-flight limit).  Anything else -- a 500 from an engine step, an internal error, a
              400 for a well-formed request, a 503 without Retry-After -- is a fault of pdserve.
    leaks     after the load every worker must be idle with every block free, checked while no
              lease can have ended yet: the run's workers get KV timeouts longer than the whole
              run (``ChaosConfig.kv_backstop_s``), and ``settle`` gives up waiting for idle before
              the first lease could end.  So a reservation or a pinned block that only its lease
              would free is still held at the check, and reported as leaked.
    parity    every greedy answer (whole, or the part streamed before a client left or a worker
              died) equals the offline engine's output for its prompt, in fp32.
"""
from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from pathlib import Path
from typing import Protocol

from launcher.local_stack import gateway_health, http_json

# What each allowed kind of error means (the keys of ``error_classes`` in the result).
ERROR_CLASSES = {
    "decode_worker_killed": "a stream cut by the SIGKILL of its decode worker (named in the error) while it ran",
    "saturated": "503 with Retry-After: no decode worker could take the request within the queue's deadline",
    "rate_limited": "429 with Retry-After: the gateway's in-flight limit",
}
_CUT_BY = re.compile(r"decode worker (\S+) failed mid-stream")


class Ended(Protocol):
    """What ``classify_error`` reads of an outcome (``chaos_scenario.Outcome``)."""

    status: int | None
    detail: str
    retry_after: str | None
    seconds: float
    ended_at: float


def classify_error(outcome: Ended, kills: list[tuple[str, float]]) -> str | None:
    """The ``ERROR_CLASSES`` key explaining an explicit error, or None when no fault explains it.
    ``kills``: (process name, ``time.monotonic()``) of every SIGKILL of the run."""
    if outcome.status == 503 and outcome.retry_after and "saturated" in outcome.detail:
        return "saturated"
    if outcome.status == 429 and outcome.retry_after:
        return "rate_limited"
    if outcome.status in (500, None):  # a non-streamed answer's status, or an error event in a stream
        cut = _CUT_BY.search(outcome.detail)
        began = outcome.ended_at - outcome.seconds
        if cut and any(name == cut.group(1) and began <= at <= outcome.ended_at for name, at in kills):
            return "decode_worker_killed"
    return None


# ---- after the load: is everything back, nothing leaked? ---------------------------------------


class Settling(Protocol):
    """What ``settle`` needs of the run's stack (``chaos_scenario.ChaosStack``)."""

    stack: object
    workers: list[str]
    admin_token: str

    def pid(self, name: str) -> int: ...


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


def migrations_so_far(url: str) -> float | None:
    """The gateway's streams moved to another decode worker so far (``None``: unreadable)."""
    try:
        return gateway_metric(url, "pdserve_migrations_total")
    except (OSError, ValueError):
        return None


async def streams_moved(url: str, before: float | None, witness: asyncio.Future, timeout_s: float) -> bool:
    """Wait until the gateway has moved a stream since it had moved ``before`` (``None``: unknown,
    no wait), the ``witness`` stream ended or ``timeout_s`` passed; whether it moved one.  A read
    that fails (a gateway busy moving streams may answer late) is read again."""
    deadline = time.monotonic() + timeout_s
    while before is not None and not witness.done() and time.monotonic() < deadline:
        now = await asyncio.to_thread(migrations_so_far, url)
        if now is not None and now > before:
            return True
        await asyncio.sleep(0.05)
    return False


async def settle(chaos: Settling, timeout_s: float, leases_end_at: float, idle_cpu_window_s: float) -> dict:
    """Wait for the stack to be idle and whole again, at most ``timeout_s`` and never past
    ``leases_end_at`` (``time.monotonic()`` at which the first lease of the run could end): the
    last look is the leak check, and a lease that ended before it would hide what only it freed.
    Then measure the workers' CPU time over ``idle_cpu_window_s`` of no traffic."""
    margin = 5.0  # one snapshot's worth of time on a loaded machine, and then some
    deadline = min(time.monotonic() + timeout_s, leases_end_at - margin)
    began = time.monotonic()
    while True:
        report = await asyncio.to_thread(_snapshot, chaos)
        checked_at = time.monotonic()
        if report["workers_healthy_at_end"] or checked_at > deadline:
            break
        await asyncio.sleep(0.5)
    report["leak_check_before_leases_end"] = checked_at < leases_end_at
    report["settle_s"] = round(checked_at - began, 1)
    import psutil

    procs = {name: psutil.Process(chaos.pid(name)) for name in chaos.workers}
    before = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
    await asyncio.sleep(idle_cpu_window_s)
    report["idle_cpu_s"] = {name: round(sum(p.cpu_times()[:2]) - before[name], 3) for name, p in procs.items()}
    report["idle_cpu_window_s"] = idle_cpu_window_s
    return report


def _snapshot(chaos: Settling) -> dict:
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
        pools = http_json(f"{stack.gateway_url}/admin/pools", headers={"X-Admin-Token": chaos.admin_token})
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


# ---- greedy answers against the offline engine ---------------------------------------------------


def reference_texts(checkpoint: Path, items: list[tuple[tuple[int, ...], int]], max_model_len: int) -> dict:
    """``{(prompt_ids, max_tokens): text}``: the offline engine's greedy output in fp32, as the
    gateway would stream it (its detokenizer over the generated ids, prompt as context)."""
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine
    from gateway.detokenizer import StreamingDecoder

    items = sorted(set(items))
    if not items:
        return {}
    engine = Engine(EngineConfig(model=str(checkpoint), dtype="float32", device="cpu", block_size=16,
                                 num_blocks=2048, max_model_len=max_model_len))
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


def summary(result: dict) -> dict:
    """The headline numbers (what the benchmark prints last)."""
    keys = ("transport", "requests", "completed", "explicit_errors", "disconnected", "hangs", "broken",
            "parity_checked", "parity_mismatches", "leaked_blocks", "leak_check_before_leases_end",
            "workers_healthy_at_end", "error_classes", "preemptions", "migrations",
            "decode_busy_answers", "remote_prefill_fallbacks", "restarts", "longest_stall_s", "load_s", "total_s")
    out = {k: result[k] for k in keys}
    out["idle_cpu_s_max"] = max(result["idle_cpu_s"].values(), default=None)
    out["hostile_ok"] = all(h["ok"] for h in result["hostile"])
    out["unexplained_errors"] = len(result["unexplained_errors"])
    return out
