"""How many prefill and how many decode workers the current load needs, and which moves get there.

A pure function of plain data (``plan(readings, targets)``), so ``pdctl rebalance`` can be tested
on synthetic load.  Rebalancing only changes roles; it never starts or stops workers (that is
``pdctl scale``).

The model, per pool (``both`` workers count for both pools and are never moved)::

    prefill demand  R = sum(prefill tokens computed per second)           -- steady arrivals
                      + sum(prefill tokens waiting) / ttft_target          -- clear the backlog in one TTFT
    per-worker rate C = --prefill-rate if given, else the best rate seen on a worker that had a
                        backlog (it was saturated), else the best rate seen (a lower bound: errs
                        towards keeping prefill workers)
    prefill needed    = ceil(R / (C * utilization)),  +1 over the current pool if TTFT > target

    decode streams  S = sum(running + waiting) on the decode pool
    decode needed     = max(ceil(S / (max_num_seqs * utilization)),       -- batch slots
                            ceil(sum(kv_usage) / kv_target)),             -- KV memory, in workers
                        +1 over the current pool if TPOT > target

Both pools need at least one worker.  The split of the movable (active, dedicated prefill/decode)
workers is the one with the smallest relative shortfall; among equally good splits, the one
closest to the current split, so a pool that already meets its target is left alone (no
flapping).  Moves take the least-loaded workers of the shrinking pool: a worker leaving the
decode pool keeps its running streams until they finish, so fewer streams leave sooner.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class WorkerReading:
    """One worker's recent load, as the registry reports it (``GET /admin/pools``)."""

    worker_id: str
    role: str
    state: str = "active"
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    waiting_prefill_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    max_num_seqs: int = 64
    ttft_s: float | None = None
    tpot_s: float | None = None

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> "WorkerReading":
        """From one ``WorkerInfo`` as JSON (an entry of ``/admin/pools``' ``workers``)."""
        load = info.get("load") or {}
        return cls(
            worker_id=info["worker_id"], role=info["role"], state=info.get("state", "active"),
            num_waiting=load.get("num_waiting", 0), num_running=load.get("num_running", 0),
            kv_usage=load.get("kv_usage", 0.0), waiting_prefill_tokens=load.get("num_waiting_prefill_tokens", 0),
            prefill_tokens_per_s=load.get("prefill_tokens_per_s", 0.0),
            max_num_seqs=(info.get("capacity") or {}).get("max_num_seqs", 64),
            ttft_s=info.get("recent_ttft_s"), tpot_s=info.get("recent_tpot_s"),
        )


@dataclass(frozen=True)
class Targets:
    """What the pools should meet; see the module docstring for how each one is used."""

    ttft_s: float = 2.0
    tpot_s: float = 0.2
    prefill_rate: float | None = None  # one worker's prefill throughput, tokens/s (None: estimate)
    utilization: float = 0.8  # plan workers to this fraction of their capacity (headroom)
    kv_target: float = 0.8  # plan decode workers to at most this KV usage

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"target {name} must be > 0, got {getattr(self, name)}")
        if self.prefill_rate is not None and not self.prefill_rate > 0:
            raise ValueError(f"prefill_rate must be > 0 tokens/s, got {self.prefill_rate}")
        for name in ("utilization", "kv_target"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class Move:
    """Change one worker's role."""

    worker_id: str
    from_role: str
    to_role: str


@dataclass
class Plan:
    """The outcome: pool sizes now and needed (``both`` workers included in each), the moves, and
    one line per decision explaining it."""

    prefill_now: int
    decode_now: int
    prefill_needed: int
    decode_needed: int
    moves: list[Move] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def prefill_needed(pool: Sequence[WorkerReading], everyone: Sequence[WorkerReading], targets: Targets,
                   reasons: list[str]) -> int:
    rate = sum(w.prefill_tokens_per_s for w in pool)
    backlog = sum(w.waiting_prefill_tokens for w in pool)
    demand = rate + backlog / targets.ttft_s
    capacity = targets.prefill_rate
    if capacity is None:
        saturated = [w.prefill_tokens_per_s for w in pool if w.waiting_prefill_tokens > 0]
        capacity = max(saturated or [w.prefill_tokens_per_s for w in pool] or [0.0])
    needed = math.ceil(demand / (capacity * targets.utilization)) if capacity > 0 else len(pool)
    reasons.append(f"prefill: {rate:.0f} tok/s computed + {backlog} tok waiting over {targets.ttft_s:g}s TTFT "
                   f"= {demand:.0f} tok/s; {capacity:.0f} tok/s per worker at {targets.utilization:.0%} "
                   f"-> {needed} worker(s)")
    ttft = _mean([w.ttft_s for w in everyone])
    if ttft is not None and ttft > targets.ttft_s and needed <= len(pool):
        needed = len(pool) + 1
        reasons.append(f"prefill: recent TTFT {ttft:.3f}s over the {targets.ttft_s:g}s target -> {needed}")
    return max(1, needed)


def decode_needed(pool: Sequence[WorkerReading], targets: Targets, reasons: list[str]) -> int:
    streams = sum(w.num_running + w.num_waiting for w in pool)
    slots = (sum(w.max_num_seqs for w in pool) / len(pool)) if pool else 64
    by_slots = math.ceil(streams / (slots * targets.utilization))
    kv = sum(w.kv_usage for w in pool)
    by_kv = math.ceil(kv / targets.kv_target - 1e-9)
    needed = max(1, by_slots, by_kv)
    reasons.append(f"decode: {streams} streams / ({slots:.0f} slots at {targets.utilization:.0%}) -> {by_slots}; "
                   f"KV in use {kv:.2f} worker(s) at {targets.kv_target:.0%} -> {by_kv}")
    tpot = _mean([w.tpot_s for w in pool])
    if tpot is not None and tpot > targets.tpot_s and needed <= len(pool):
        needed = len(pool) + 1
        reasons.append(f"decode: recent TPOT {tpot:.3f}s over the {targets.tpot_s:g}s target -> {needed}")
    return needed


def choose_split(movable: int, both: int, prefill_now: int, need_p: int, need_d: int) -> int:
    """The number of dedicated prefill workers (of ``movable``) that best meets both needs."""

    def score(p: int) -> tuple[float, int, int]:
        short_p = max(0, need_p - (p + both)) / need_p
        short_d = max(0, need_d - (movable - p + both)) / need_d
        return (short_p + short_d, abs(p - prefill_now), p)

    allowed = [p for p in range(movable + 1) if p + both >= 1 and movable - p + both >= 1]
    return min(allowed, key=score) if allowed else prefill_now


def moves_to(num_prefill: int, dedicated_p: Sequence[WorkerReading], dedicated_d: Sequence[WorkerReading]
             ) -> list[Move]:
    """The moves that leave ``num_prefill`` dedicated prefill workers, taking the least-loaded
    workers of the shrinking pool (a decode worker leaving keeps its streams until they finish)."""
    if num_prefill > len(dedicated_p):
        leaving = sorted(dedicated_d, key=lambda w: (w.num_running + w.num_waiting, w.kv_usage, w.worker_id))
        return [Move(w.worker_id, "decode", "prefill") for w in leaving[:num_prefill - len(dedicated_p)]]
    if num_prefill < len(dedicated_p):
        leaving = sorted(dedicated_p, key=lambda w: (w.waiting_prefill_tokens, w.num_running + w.num_waiting,
                                                   w.prefill_tokens_per_s, w.worker_id))
        return [Move(w.worker_id, "prefill", "decode") for w in leaving[:len(dedicated_p) - num_prefill]]
    return []


def plan(readings: Sequence[WorkerReading], targets: Targets = Targets()) -> Plan:
    """The moves that bring the pools to the split the load needs (see the module docstring).

    Only ``active`` workers count: starting, draining and idle ones are left as they are.
    """
    active = [w for w in readings if w.state == "active"]
    prefill_pool = [w for w in active if w.role in ("prefill", "both")]
    decode_pool = [w for w in active if w.role in ("decode", "both")]
    dedicated_p = [w for w in active if w.role == "prefill"]
    dedicated_d = [w for w in active if w.role == "decode"]
    both = len(active) - len(dedicated_p) - len(dedicated_d)
    reasons: list[str] = []
    need_p = prefill_needed(prefill_pool, active, targets, reasons)
    need_d = decode_needed(decode_pool, targets, reasons)
    result = Plan(len(prefill_pool), len(decode_pool), need_p, need_d, reasons=reasons)
    movable = len(dedicated_p) + len(dedicated_d)
    p = choose_split(movable, both, len(dedicated_p), need_p, need_d)
    result.moves = moves_to(p, dedicated_p, dedicated_d)
    if need_p + need_d > movable + 2 * both and movable:
        reasons.append(f"not enough workers for both targets ({need_p} prefill + {need_d} decode needed, "
                       f"{movable + both} available): split to the smallest relative shortfall")
    return result
