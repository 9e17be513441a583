"""The traffic a plan is made for: synthetic (rate, arrival process, length distributions, shared
system prompts) or a trace file.

Either way the result is a ``Workload``: arrays of arrival times, prompt and output lengths, and
per request the content of its prompt as *segments* -- shared blocks named by an id, then a part
unique to the request.  ``prompt_tokens(i)`` turns that into token ids, deterministically, so
that two requests naming the same shared block get identical tokens and the real prefix cache
(chained block hashes, token-checked hits) finds what a production cache would find::

    Mooncake / aiperf trace line:  {"timestamp": 1200, "input_length": 1300, "output_length": 80,
                                    "hash_ids": [7, 8, 41]}      (one id per 512-token block)
    tokens:   [ block 7 (512) | block 8 (512) | block 41, cut to 276 ]

    synthetic, --prefix-groups 4 --prefix-len 1024:
    tokens:   [ system prompt g (1024, shared by group g) | unique suffix ]

Trace fields: ``timestamp`` (ms since the start) or ``delay`` (ms after the previous line),
``input_length`` (or ``text_input``, counted as one token per 4 characters), ``output_length``,
optional ``hash_ids``.  Blank lines and lines starting with ``#`` are skipped.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# Token ids the planner makes up: shared blocks and unique prompts use disjoint ranges, so a
# collision between a shared block and a request's own tokens is impossible.
_SHARED_BASE = 1 << 20
_UNIQUE_BASE = 1 << 28
_OUTPUT_TOKEN = 7
MAX_TRACE_LINE = 1 << 20


@dataclass(frozen=True)
class LengthDist:
    """Integer lengths: ``fixed:N``, ``uniform:LO:HI``, ``loguniform:LO:HI``,
    ``normal:MEAN:STD`` or ``lognormal:MEDIAN:SIGMA`` (the last two clipped to >= 1)."""

    kind: str
    a: float
    b: float = 0.0

    KINDS = ("fixed", "uniform", "loguniform", "normal", "lognormal")

    @classmethod
    def parse(cls, text: str) -> "LengthDist":
        parts = str(text).split(":")
        try:
            if parts[0] == "fixed" and len(parts) == 2 and int(parts[1]) >= 1:
                return cls("fixed", int(parts[1]))
            if parts[0] in ("uniform", "loguniform") and len(parts) == 3:
                low, high = int(parts[1]), int(parts[2])
                if 1 <= low <= high:
                    return cls(parts[0], low, high)
            if parts[0] in ("normal", "lognormal") and len(parts) == 3:
                a, b = float(parts[1]), float(parts[2])
                if a > 0 and b >= 0:
                    return cls(parts[0], a, b)
        except ValueError:
            pass
        raise ValueError(f"length distribution {text!r}: expected fixed:N, uniform:LO:HI, loguniform:LO:HI, "
                         "normal:MEAN:STD or lognormal:MEDIAN:SIGMA with positive lengths")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            out = np.full(n, self.a)
        elif self.kind == "uniform":
            out = rng.integers(int(self.a), int(self.b) + 1, n)
        elif self.kind == "loguniform":
            out = np.exp(rng.uniform(math.log(self.a), math.log(self.b), n))
        elif self.kind == "normal":
            out = rng.normal(self.a, self.b, n)
        else:
            out = self.a * np.exp(rng.normal(0.0, self.b, n))
        return np.maximum(1, np.rint(out)).astype(np.int64)

    @property
    def mean(self) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        if self.kind == "loguniform":
            return (self.b - self.a) / math.log(self.b / self.a) if self.b > self.a else self.a
        if self.kind == "normal":
            return self.a
        return self.a * math.exp(self.b ** 2 / 2)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind in ("uniform", "loguniform"):
            return f"{self.kind}:{int(self.a)}:{int(self.b)}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


def arrival_times(rng: np.random.Generator, rate: float, duration: float, process: str = "poisson",
                  cv: float = 1.0) -> np.ndarray:
    """Arrival times in ``[0, duration)``: Poisson, or gamma-distributed gaps with coefficient of
    variation ``cv`` (``cv > 1`` is bursty, ``cv < 1`` smoother than Poisson) at the same mean rate."""
    if not rate > 0 or not duration > 0:
        raise ValueError(f"rate and duration must be > 0, got {rate} req/s for {duration} s")
    if process not in ("poisson", "gamma"):
        raise ValueError(f"arrival process {process!r}: expected poisson or gamma")
    if process == "gamma" and not cv > 0:
        raise ValueError(f"gamma arrivals need cv > 0, got {cv}")
    expected = rate * duration
    n = int(expected + 6 * math.sqrt(expected * max(1.0, cv * cv)) + 16)
    if process == "poisson":
        gaps = rng.exponential(1.0 / rate, n)
    else:
        shape = 1.0 / (cv * cv)
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    times = np.cumsum(gaps)
    return times[times < duration]


@dataclass
class Workload:
    """Requests to simulate, as parallel arrays (one entry per request, by arrival time).

    ``shared[i]`` is a tuple of shared-block ids (trace ``hash_ids`` or a system prompt's blocks),
    each ``shared_block_tokens`` long; the rest of the prompt is unique to the request.
    """

    arrival: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    shared: list[tuple[int, ...]] = field(default_factory=list)
    shared_block_tokens: int = 512
    description: str = ""

    def __post_init__(self) -> None:
        n = len(self.arrival)
        if not (len(self.prompt_len) == len(self.output_len) == n):
            raise ValueError("arrival, prompt_len and output_len must have one entry per request")
        if not self.shared:
            self.shared = [()] * n
        order = np.argsort(self.arrival, kind="stable")
        if (order != np.arange(n)).any():
            self.arrival, self.prompt_len, self.output_len = (
                self.arrival[order], self.prompt_len[order], self.output_len[order])
            self.shared = [self.shared[i] for i in order]

    def __len__(self) -> int:
        return len(self.arrival)

    @property
    def duration(self) -> float:
        return float(self.arrival[-1]) if len(self.arrival) else 0.0

    @property
    def has_shared_prefixes(self) -> bool:
        return any(self.shared)

    def prompt_tokens(self, i: int) -> list[int]:
        """Token ids of request ``i``'s prompt: shared blocks first, then its own tokens."""
        n = int(self.prompt_len[i])
        bs = self.shared_block_tokens
        tokens: list[int] = []
        for block_id in self.shared[i]:
            if len(tokens) >= n:
                break
            tokens += [_SHARED_BASE + block_id % (_UNIQUE_BASE - _SHARED_BASE)] * bs
        del tokens[n:]
        # The request's own part: its number as every token (unique, so never a false prefix hit).
        tokens += [_UNIQUE_BASE + i % (1 << 30)] * (n - len(tokens))
        return tokens

    def subset(self, keep: np.ndarray, description: str | None = None) -> "Workload":
        """The requests where ``keep`` is true (a boolean mask), same order."""
        index = np.flatnonzero(keep)
        return Workload(self.arrival[index], self.prompt_len[index], self.output_len[index],
                        [self.shared[i] for i in index], self.shared_block_tokens,
                        description if description is not None else self.description)

    def summary(self) -> dict:
        n = len(self)
        return {"requests": n, "duration_s": round(self.duration, 2),
                "rate_req_s": round(n / self.duration, 3) if self.duration > 0 else None,
                "prompt_len_mean": round(float(self.prompt_len.mean()), 1) if n else None,
                "output_len_mean": round(float(self.output_len.mean()), 1) if n else None,
                "shared_prefixes": self.has_shared_prefixes, "description": self.description}


def synthetic(rate: float, duration: float, prompt_len: LengthDist, output_len: LengthDist,
              process: str = "poisson", cv: float = 1.0, prefix_groups: int = 0, prefix_len: int = 0,
              seed: int = 0, max_model_len: int | None = None) -> Workload:
    """A synthetic workload.  With ``prefix_groups`` > 0 every prompt starts with one of that many
    shared system prompts of ``prefix_len`` tokens (drawn uniformly), followed by ``prompt_len``
    tokens of its own."""
    rng = np.random.default_rng(seed)
    times = arrival_times(rng, rate, duration, process, cv)
    n = len(times)
    prompts = prompt_len.sample(rng, n)
    outputs = output_len.sample(rng, n)
    shared: list[tuple[int, ...]] = []
    block = 512
    if prefix_groups > 0 and prefix_len > 0:
        # Each system prompt is one shared segment of ``prefix_len`` tokens, named by its group.
        block = prefix_len
        prompts = prompts + prefix_len
        shared = [(int(g),) for g in rng.integers(0, prefix_groups, n)]
    if max_model_len:
        prompts = np.minimum(prompts, max_model_len - 1)
        outputs = np.minimum(outputs, max_model_len - prompts)
    desc = (f"{process}{'' if process == 'poisson' else f' cv={cv:g}'} {rate:g} req/s for {duration:g} s, "
            f"prompt {prompt_len}, output {output_len}"
            + (f", {prefix_groups} shared prefixes of {prefix_len}" if prefix_groups and prefix_len else ""))
    return Workload(times, prompts, outputs, shared, block, desc)


def load_trace(path: str | Path, block_tokens: int = 512, default_output_len: int | None = None,
               time_scale: float = 1.0, max_requests: int | None = None) -> Workload:
    """A Mooncake / aiperf ``mooncake_trace`` JSONL file (see the module docstring).

    ``time_scale`` stretches (>1) or compresses (<1) the timestamps, i.e. divides the rate.
    Raises ``ValueError`` naming the line and the field for anything malformed.
    """
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if block_tokens < 1:
        raise ValueError(f"trace block size must be >= 1, got {block_tokens}")
    times, prompts, outputs, shared = [], [], [], []
    clock = 0.0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if len(raw) > MAX_TRACE_LINE:
                raise ValueError(f"{path}:{lineno}: line longer than {MAX_TRACE_LINE} bytes")
            line = raw.strip()
            if not line or line.startswith(b"#"):
                continue
            try:
                rec = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            where = f"{path}:{lineno}"
            if "timestamp" in rec:
                clock = _number(rec, "timestamp", where, minimum=0) / 1000.0
            elif "delay" in rec:
                clock += _number(rec, "delay", where, minimum=0) / 1000.0
            if "input_length" in rec:
                n_in = int(_number(rec, "input_length", where, minimum=1))
            elif isinstance(rec.get("text_input"), str) and rec["text_input"]:
                n_in = max(1, len(rec["text_input"]) // 4)
            else:
                raise ValueError(f"{where}: needs input_length (or text_input)")
            if "output_length" in rec:
                n_out = int(_number(rec, "output_length", where, minimum=1))
            elif default_output_len:
                n_out = default_output_len
            else:
                raise ValueError(f"{where}: needs output_length (or pass a default output length)")
            ids = rec.get("hash_ids") or []
            if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0
                                                    for h in ids):
                raise ValueError(f"{where}: hash_ids must be a list of non-negative integers")
            if len(ids) > math.ceil(n_in / block_tokens):
                raise ValueError(f"{where}: {len(ids)} hash_ids for {n_in} input tokens at {block_tokens} "
                                 "tokens per id (wrong --trace-block-size?)")
            times.append(clock * time_scale)
            prompts.append(n_in)
            outputs.append(n_out)
            shared.append(tuple(ids))
            if max_requests and len(times) >= max_requests:
                break
    if not times:
        raise ValueError(f"{path}: no requests in the trace")
    start = min(times)
    return Workload(np.asarray(times) - start, np.asarray(prompts, dtype=np.int64),
                    np.asarray(outputs, dtype=np.int64), shared, block_tokens,
                    f"trace {Path(path).name}" + (f" x{time_scale:g} time" if time_scale != 1 else ""))


def _number(rec: dict, key: str, where: str, minimum: float) -> float:
    value = rec[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise ValueError(f"{where}: {key} must be a number >= {minimum:g}, got {value!r}")
    return float(value)


def output_token() -> int:
    """The token every simulated decode step 'samples' (lengths are set by max_tokens, as with ignore_eos)."""
    return _OUTPUT_TOKEN
