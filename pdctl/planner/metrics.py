"""What a simulation reports: latency percentiles, goodput, KV usage, preemptions, transfers.

Definitions follow ``benchmarks/loadgen.py`` so predictions and measurements compare directly:
TTFT = first token - arrival; TPOT = (end - first token) / (output tokens - 1); ITL = gaps
between a request's tokens; goodput = requests per second that meet both SLOs (a single-token
answer needs only the TTFT one).  A request that failed or had not finished when the simulation
ended counts as infinitely late, so an overloaded deployment shows up in the percentiles.
Percentiles are nearest-rank, as in ``benchmarks/bench_util.percentile``.
"""
from __future__ import annotations

import math

import numpy as np

QUANTILES = (50, 90, 99)


def percentile(values, q: float) -> float:
    """Nearest-rank percentile (``inf`` entries allowed); ``nan`` for no values."""
    a = np.sort(np.asarray(values, dtype=float))
    if not len(a):
        return math.nan
    return float(a[min(len(a) - 1, max(0, math.ceil(q / 100 * len(a)) - 1))])


def weighted_percentile(values, weights, q: float) -> float:
    v = np.asarray(values, dtype=float)
    if not len(v):
        return math.nan
    w = np.asarray(weights, dtype=float)
    order = np.argsort(v)
    cum = np.cumsum(w[order])
    k = np.searchsorted(cum, q / 100 * cum[-1], side="left")
    return float(v[order][min(k, len(v) - 1)])


def _ms(value: float) -> float | None:
    if value != value:
        return None
    return math.inf if math.isinf(value) else round(value * 1e3, 3)


def pcts(values) -> dict:
    return {f"p{q}": _ms(percentile(values, q)) for q in QUANTILES}


def slo_ratio(ttft_p90_s: float, tpot_p90_s: float, slo_ttft_s: float, slo_tpot_s: float) -> float:
    """How far the worse of the two p90s is from its SLO: <= 1 meets both.  Ranks configurations."""
    tpot = 0.0 if tpot_p90_s != tpot_p90_s else tpot_p90_s / slo_tpot_s
    return max(ttft_p90_s / slo_ttft_s, tpot)


def certainly_failing(sim, now: float) -> bool:
    """More than 10% of all requests of the simulation ``sim`` already miss an SLO at ``now``: its
    p90 cannot meet it any more (``SimConfig.stop_when_failing`` ends the run then)."""
    cfg, wl = sim.config, sim.workload
    limit = 0.1 * len(wl)
    late = 0
    for i in range(len(wl)):
        arrival = wl.arrival[i]
        if arrival > now:
            break
        ft = sim.first_token[i]
        if sim.outcome[i].startswith("error") or (ft == ft and ft - arrival > cfg.slo_ttft_s) or (
                ft != ft and now - arrival > cfg.slo_ttft_s):
            late += 1
        elif sim.finish[i] == sim.finish[i] and wl.output_len[i] > 1:
            if (sim.finish[i] - ft) / (wl.output_len[i] - 1) > cfg.slo_tpot_s:
                late += 1
    return late > limit


def summarize_simulation(sim, wall_s: float) -> dict:
    wl, cfg = sim.workload, sim.config
    arrival = wl.arrival
    n = len(wl)
    first = np.asarray(sim.first_token, dtype=float)
    finish = np.asarray(sim.finish, dtype=float)
    out_len = wl.output_len.astype(float)
    ok = np.array([o == "ok" for o in sim.outcome], dtype=bool)
    errors = sum(1 for o in sim.outcome if o.startswith("error"))
    ttft = np.where(np.isnan(first), math.inf, first - arrival)
    multi = out_len > 1
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot_all = np.where(ok, (finish - first) / np.maximum(out_len - 1, 1), math.inf)
    tpot = tpot_all[multi]
    e2e = np.where(ok, finish - arrival, math.inf)
    good = ok & (ttft <= cfg.slo_ttft_s) & (~multi | (tpot_all <= cfg.slo_tpot_s))
    end = float(np.nanmax(finish)) if ok.any() else sim.now
    span = max(wl.duration, end) or 1.0
    scale = 1.0 / sim.fraction
    ttft_p90 = percentile(ttft, 90)
    tpot_p90 = percentile(tpot, 90) if len(tpot) else math.nan
    workers = list(sim.workers.values())

    def pool(roles):
        members = [w for w in workers if w.role in roles]
        if not members:
            return None
        horizon = max(sim.now, 1e-9)
        return {"workers": len(members),
                "kv_usage_mean": round(sum(w.usage_area for w in members) / (horizon * len(members)), 4),
                "kv_usage_peak": round(max(w.usage_peak for w in members), 4),
                "busy": round(sum(w.busy_time for w in members) / (horizon * len(members)), 4),
                # Spread of load over the pool: how evenly the router placed the work.
                "busy_min": round(min(w.busy_time for w in members) / horizon, 4),
                "busy_max": round(max(w.busy_time for w in members) / horizon, 4),
                "steps": sum(w.steps for w in members),
                "preemptions": sum(w.preemptions for w in members)}

    d = sim.deployment
    ratio = slo_ratio(ttft_p90, tpot_p90, cfg.slo_ttft_s, cfg.slo_tpot_s)
    return {
        "deployment": d.label, "prefill": d.prefill, "decode": d.decode, "both": d.both, "gpus": d.gpus,
        "requests": n, "completed": int(ok.sum()), "errors": errors, "unfinished": int(n - ok.sum() - errors),
        "ttft_ms": pcts(ttft), "tpot_ms": pcts(tpot), "e2e_ms": pcts(e2e),
        "itl_ms": {f"p{q}": _ms(weighted_percentile(sim.itl_values, sim.itl_weights, q)) for q in QUANTILES},
        "goodput_req_s": round(float(good.sum()) / span * scale, 4),
        "throughput_req_s": round(float(ok.sum()) / span * scale, 4),
        "output_tok_s": round(float(out_len[ok].sum()) / span * scale, 2),
        "slo_attained": round(float(good.sum()) / n, 4) if n else None,
        "slo_ratio": None if math.isinf(ratio) or ratio != ratio else round(ratio, 4),
        "meets_slo": bool(ratio <= 1.0 and errors == 0 and not sim.stopped_early),
        "prefill_pool": pool(("prefill",)), "decode_pool": pool(("decode", "both")),
        "preemptions": sum(w.preemptions for w in workers),
        "remote_prefills": sum(1 for k in sim.route_kind if k == "remote"),
        "local_prefills": sum(1 for k in sim.route_kind if k == "local"),
        "decode_busy_answers": sim.retries, "queued_requests": sim.queued,
        "transfer_gb": round(sim.transfer_bytes * scale / 1e9, 4),
        "transfer_gb_s": round(sim.transfer_bytes * scale / 1e9 / span, 4),
        "traffic_fraction": round(sim.fraction, 6),
        "stopped_early": sim.stopped_early,
        "sim_wall_s": round(wall_s, 3),
    }
