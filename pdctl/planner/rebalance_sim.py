"""``pdctl rebalance --gpu/--calibration``: choose the prefill:decode split by simulation.

The plain rebalance model (``pdctl/rebalance.py``) sizes each pool from throughput rules.  With
a cost model, ``pdctl rebalance`` instead simulates the expected traffic on every split of the
workers it may move (the real scheduler and router, as ``pdctl plan`` does) and picks:

    1. the current split, if it meets the TTFT/TPOT targets (as p90s) and no other split has
       at least 10% more headroom -- so a healthy deployment is left alone (no flapping);
    2. otherwise the split that meets them with the most headroom (smallest ``slo_ratio``);
    3. if none meets them, the one that misses them by the least.

``both`` workers count for both pools and are never moved; each pool keeps at least one worker.
The traffic is the one the flags describe; without ``--rate`` the rate is estimated from the
readings: the prompt tokens per second the prefill pool computes now, divided by the mean prompt
length of the traffic model.
"""
from __future__ import annotations

from typing import Callable, Sequence

from pdctl.planner.search import simulate
from pdctl.planner.sim_config import Deployment, SimConfig
from pdctl.planner.traffic import Workload
from pdctl.rebalance import Plan, WorkerReading, moves_to

KEEP_MARGIN = 0.9  # another split must have at least 10% more headroom to replace a healthy one


def estimated_rate(readings: Sequence[WorkerReading], mean_prompt_len: float) -> float | None:
    """Requests/s from the prefill pool's computed prompt tokens/s (None if it computed nothing)."""
    tokens = sum(w.prefill_tokens_per_s for w in readings if w.state == "active" and w.role in ("prefill", "both"))
    return tokens / mean_prompt_len if tokens > 0 and mean_prompt_len > 0 else None


def simulated_plan(readings: Sequence[WorkerReading], workload: Workload, config: SimConfig, budget: float,
                   log: Callable[[str], None] | None = None) -> Plan:
    active = [w for w in readings if w.state == "active"]
    dedicated_p = [w for w in active if w.role == "prefill"]
    dedicated_d = [w for w in active if w.role == "decode"]
    both = len(active) - len(dedicated_p) - len(dedicated_d)
    movable = len(dedicated_p) + len(dedicated_d)
    now_p = len(dedicated_p)
    reasons: list[str] = [f"traffic model: {workload.description}; SLOs p90 TTFT {config.slo_ttft_s:g}s, "
                          f"TPOT {config.slo_tpot_s:g}s; cost model: {config.cost.describe()}"]
    results: dict[int, dict] = {}
    for p in range(movable + 1):
        if p + both < 1 or movable - p + both < 1:
            continue
        r = simulate(Deployment(p, movable - p, both), workload, config, budget)
        results[p] = r
        line = (f"split {r['deployment']}: TTFT p90 {_ms(r['ttft_ms']['p90'])}, TPOT p90 {_ms(r['tpot_ms']['p90'])}, "
                f"goodput {r['goodput_req_s']:.3g} req/s -> {'meets' if r['meets_slo'] else 'misses'} the targets"
                f"{' (current)' if p == now_p else ''}")
        reasons.append(line)
        if log:
            log(line)
    if not results:
        return Plan(now_p + both, len(dedicated_d) + both, now_p + both, len(dedicated_d) + both, [],
                    reasons + ["nothing to move: no active dedicated workers"])

    def headroom(p: int) -> float:
        ratio = results[p]["slo_ratio"]
        return float("inf") if ratio is None else ratio

    meeting = [p for p in results if results[p]["meets_slo"]]
    best = min(meeting or results, key=lambda p: (headroom(p), abs(p - now_p)))
    if now_p in meeting and headroom(best) >= KEEP_MARGIN * headroom(now_p):
        best = now_p
        reasons.append(f"keep {results[now_p]['deployment']}: it meets the targets and no split has 10% more headroom")
    elif meeting:
        reasons.append(f"choose {results[best]['deployment']}: meets the targets with the most headroom "
                       f"(worst p90 at {headroom(best):.0%} of its target)")
    else:
        reasons.append(f"no split meets the targets; {results[best]['deployment']} misses them by the least "
                       f"(worst p90 at {headroom(best):.0%} of its target): more workers are needed (pdctl scale)")
    moves = moves_to(best, dedicated_p, dedicated_d)
    return Plan(now_p + both, len(dedicated_d) + both, best + both, movable - best + both, moves, reasons)


def _ms(value) -> str:
    if value is None:
        return "-"
    return "inf" if value == float("inf") else f"{value:.0f} ms"
