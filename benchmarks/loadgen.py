"""Open-loop load generation against an OpenAI-compatible ``/v1/completions`` endpoint.

A workload is a list of ``PlannedRequest``: a token-id prompt (so prompt lengths are exact), a
``max_tokens`` (sent with ``ignore_eos`` so output lengths are exact too), a send time in seconds
after the start, and a ``kind`` label that the report groups by.  ``run_load`` sends request i at
its send time whether or not earlier ones have finished (open loop: a slow server builds a queue,
it does not slow the clients down), streams every answer over SSE, and records per request::

    send ---- first text chunk ---- chunk ---- chunk ... last chunk ---- [DONE]
         TTFT                  ITL       ITL              (e2e = last chunk - send)
    TPOT = (e2e - TTFT) / (output_tokens - 1)      output_tokens from the usage chunk

Arrivals are Poisson (exponential gaps) from a seeded ``random.Random``; lengths come from a
``LengthDist`` ("uniform:LO:HI", "loguniform:LO:HI" or "fixed:N").  Everything is deterministic
given the seed.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import aiohttp

from benchmarks.bench_util import percentile


@dataclass(frozen=True)
class LengthDist:
    """Integer lengths: ``uniform:LO:HI`` (inclusive), ``loguniform:LO:HI`` or ``fixed:N``."""

    kind: str
    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> "LengthDist":
        parts = text.split(":")
        try:
            if parts[0] == "fixed" and len(parts) == 2:
                return cls("fixed", int(parts[1]), int(parts[1]))
            if parts[0] in ("uniform", "loguniform") and len(parts) == 3:
                low, high = int(parts[1]), int(parts[2])
                if 1 <= low <= high:
                    return cls(parts[0], low, high)
        except ValueError:
            pass
        raise ValueError(f"length distribution {text!r}: expected uniform:LO:HI, loguniform:LO:HI or fixed:N "
                         "with 1 <= LO <= HI")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        if self.kind == "loguniform":
            return int(round(math.exp(rng.uniform(math.log(self.low), math.log(self.high)))))
        return self.low

    def __str__(self) -> str:
        return f"fixed:{self.low}" if self.kind == "fixed" else f"{self.kind}:{self.low}:{self.high}"


@dataclass(frozen=True)
class PlannedRequest:
    prompt: list[int]
    max_tokens: int
    send_at: float  # seconds after the start of the run
    kind: str


@dataclass
class Record:
    """What one request measured; times are seconds relative to the run's start."""

    kind: str
    prompt_tokens: int
    max_tokens: int
    send: float
    chunk_times: list[float] = field(default_factory=list)
    end: float | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.send

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens or len(self.chunk_times)
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None


def poisson_times(rng: random.Random, rate: float, count: int, start: float = 0.0) -> list[float]:
    """``count`` arrival times of a Poisson process of ``rate`` per second, from ``start``."""
    times, t = [], start
    for _ in range(count):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Token ids from a fixed range that avoids the usual special ids 0..2."""
    return [rng.randrange(3, vocab) for _ in range(n)]


async def _send(session: aiohttp.ClientSession, url: str, model: str, req: PlannedRequest, t0: float,
                timeout: float, temperature: float = 0.0) -> Record:
    rec = Record(req.kind, len(req.prompt), req.max_tokens, send=time.perf_counter() - t0)
    payload = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": temperature,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with session.post(f"{url}/v1/completions", json=payload,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"[:300]
                    break
                if any(c.get("text") for c in chunk.get("choices") or ()):
                    rec.chunk_times.append(time.perf_counter() - t0)
                usage = chunk.get("usage")
                if usage:
                    rec.output_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = details.get("cached_tokens")
        if rec.error is None and not rec.chunk_times:
            rec.error = "no tokens streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        rec.end = time.perf_counter() - t0
    return rec


async def run_load(url: str, model: str, plan: list[PlannedRequest], timeout: float = 600) -> tuple[list[Record], float]:
    """Send ``plan`` open-loop; returns the records (in plan order) and the wall time of the run."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()

        async def at(req: PlannedRequest) -> Record:
            delay = req.send_at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            return await _send(session, url, model, req, t0, timeout)

        records = await asyncio.gather(*(at(r) for r in plan))
    return list(records), time.perf_counter() - t0


async def run_closed_loop(url: str, model: str, plan: list[PlannedRequest], concurrency: int,
                          timeout: float = 600, temperature: float = 0.0) -> tuple[list[Record], float]:
    """Send ``plan`` with ``concurrency`` clients, each sending its next request when its last one
    ends (``send_at`` ignored); returns the records (in plan order) and the wall time."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    records: list[Record | None] = [None] * len(plan)
    next_index = iter(range(len(plan)))
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()

        async def client() -> None:
            for i in next_index:
                records[i] = await _send(session, url, model, plan[i], t0, timeout, temperature)

        await asyncio.gather(*(client() for _ in range(max(1, concurrency))))
    return list(records), time.perf_counter() - t0


def summarize(records: list[Record], wall: float, slo_ttft: float, slo_tpot: float) -> dict:
    """Percentiles (ms), throughput and goodput (requests/s meeting both SLOs) of ``records``."""
    ok = [r for r in records if r.ok]

    def pcts(values: list[float]) -> dict:
        return {f"p{q}": round(percentile(values, q) * 1e3, 2) if values else None for q in (50, 90, 99)}

    tpots = [r.tpot for r in ok if r.tpot is not None]
    good = [r for r in ok if r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)]
    out_tokens = sum(r.output_tokens or len(r.chunk_times) for r in ok)
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "error_samples": sorted({r.error for r in records if r.error})[:3],
        "ttft_ms": pcts([r.ttft for r in ok]),
        "tpot_ms": pcts(tpots),
        "itl_ms": pcts([g for r in ok for g in r.itls]),
        "e2e_ms": pcts([r.e2e for r in ok]),
        "output_tok_s": round(out_tokens / wall, 2) if wall > 0 else None,
        "request_s": round(len(ok) / wall, 3) if wall > 0 else None,
        "goodput_req_s": round(len(good) / wall, 3) if wall > 0 else None,
        "slo_attained": round(len(good) / len(records), 3) if records else None,
    }
