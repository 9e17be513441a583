"""Which deployments to simulate, how much of each, and which one to recommend.

1. **Fluid bound** (``fluid_estimate``): from the cost model alone, the prefill GPUs that keep
   up with the prompt tokens per second and the decode GPUs that produce the output tokens per
   second at a batch whose step still meets the TPOT SLO.  Cheap, optimistic (no queueing, no
   burst): it only says where to start looking.
2. **Simulation** of candidate splits around that bound, each with the real scheduler and router
   (``Simulation``), cheapest GPU count first; a candidate stops early once more than 10% of all
   requests have missed an SLO (its p90 can no longer meet it).
3. **Recommendation**: the fewest GPUs whose simulated TTFT p90 and TPOT p90 meet the SLOs with no
   errors; among those, the one with the most headroom (smallest ``slo_ratio``).

**Sampling** (``slice_for``): the simulated work is about one scheduler pass per request per
output token.  When the whole cluster's estimate exceeds the budget, a slice of it with the same
prefill:decode ratio is simulated on the matching share of the traffic -- whole prefix groups
when there are many (as rendezvous routing partitions them), otherwise a random thinning, which
keeps Poisson arrivals Poisson.  Each simulated worker then sees the per-worker load of the full
cluster; what a slice cannot show is routing balance across more workers than it holds.
"""
from __future__ import annotations

import dataclasses
import math
import time
import zlib
from dataclasses import dataclass

import numpy as np

from pdctl.planner.metrics import slo_ratio
from pdctl.planner.sim_config import DEFAULT_BUDGET, Deployment, SimConfig
from pdctl.planner.simulator import Simulation
from pdctl.planner.traffic import Workload


def estimate_work(workload: Workload, config: SimConfig) -> float:
    """Request-steps of the whole workload: one per output token plus one per prefill chunk."""
    chunk = (config.prefill_engine or config.engine).max_num_batched_tokens
    return float(workload.output_len.sum() + np.ceil(workload.prompt_len / chunk).sum())


@dataclass(frozen=True)
class Slice:
    deployment: Deployment  # what is simulated
    fraction: float  # of the cluster's GPUs (and so of its traffic)
    load_skew: float  # max/min over roles of (simulated workers / cluster workers): 1.0 is exact


MAX_SLICE_SKEW = 1.1  # a slice's per-worker load may differ from the cluster's by at most 10% per role


def slice_for(deployment: Deployment, work: float, budget: float) -> Slice:
    """The largest slice of ``deployment`` whose share of ``work`` fits ``budget`` (see the module
    docstring).  Only slices that keep every role's per-worker load within ``MAX_SLICE_SKEW`` of the
    cluster's qualify; when none does (an odd ratio such as 5:1), the whole cluster is simulated."""
    counts = (deployment.prefill, deployment.decode, deployment.both)
    whole = Slice(deployment, 1.0, 1.0)
    if work <= budget:
        return whole
    fitting = []
    for m in range(2, max(counts) + 1):
        sizes = tuple(max(1, round(c / m)) if c else 0 for c in counts)
        fractions = [s / c for s, c in zip(sizes, counts) if c]
        skew = max(fractions) / min(fractions)
        if skew > MAX_SLICE_SKEW:
            continue
        piece = Slice(dataclasses.replace(deployment, prefill=sizes[0], decode=sizes[1], both=sizes[2]),
                      sum(sizes) / sum(counts), skew)
        if work * piece.fraction <= budget:
            return piece
        fitting.append(piece)
    return min(fitting, key=lambda p: p.fraction) if fitting else whole


def thin(workload: Workload, fraction: float, seed: int = 0) -> Workload:
    """A ``fraction`` of the requests (see the module docstring for how they are chosen)."""
    if fraction >= 1.0:
        return workload
    rng = np.random.default_rng(seed + 7919)
    keep = rng.random(len(workload)) < fraction
    groups = {s[0] for s in workload.shared if s}
    if len(groups) >= 8 / fraction:
        # Many prefix groups: the slice owns whole groups, as prefix-affine routing would give it.
        threshold = int(fraction * (1 << 32))
        for i, shared in enumerate(workload.shared):
            if shared:
                keep[i] = zlib.crc32(shared[0].to_bytes(8, "little")) < threshold
    return workload.subset(keep, workload.description + f" (sampled {fraction:.4g})")


def simulate(deployment: Deployment, workload: Workload, config: SimConfig, budget: float = DEFAULT_BUDGET
             ) -> dict:
    """One deployment, sampled if it is too big for ``budget``; the result says how it was run."""
    piece = slice_for(deployment, estimate_work(workload, config), budget)
    part = thin(workload, piece.fraction, config.seed)
    began = time.process_time()
    result = Simulation(piece.deployment, part, config, traffic_fraction=piece.fraction).run()
    # Report the cluster that was asked about; the slice that ran is under "simulated".
    result.update(deployment=deployment.label, prefill=deployment.prefill, decode=deployment.decode,
                  both=deployment.both, gpus=deployment.gpus, prefill_tp=deployment.prefill_tp,
                  decode_tp=deployment.decode_tp, both_tp=deployment.both_tp)
    result["simulated"] = {"deployment": piece.deployment.label, "traffic_fraction": round(piece.fraction, 6),
                           "load_skew": round(piece.load_skew, 4), "requests": len(part),
                           "cpu_s": round(time.process_time() - began, 3)}
    return result


# ---- fluid bound -----------------------------------------------------------------------------


def fluid_estimate(workload: Workload, config: SimConfig) -> dict:
    """Lower bounds on prefill and decode GPUs (see the module docstring)."""
    cost, engine = config.cost, config.engine
    prefill_engine = config.prefill_engine or engine
    duration = max(workload.duration, 1e-9)
    rate = len(workload) / duration
    prompt = float(workload.prompt_len.mean())
    output = float(workload.output_len.mean())
    chunk = min(prefill_engine.max_num_batched_tokens, max(1, int(prompt)))
    # One chunk at the mean prompt's middle: tokens computed per second by a busy prefill GPU.
    t_chunk = cost.step_time(chunk, 1, 1, chunk * (prompt / 2 + (chunk + 1) / 2), int(prompt / 2 + chunk))
    prefill_rate = chunk / t_chunk
    context = prompt + output / 2
    kv_tokens = engine.num_blocks * engine.block_size * 0.9
    max_batch = max(1, min(engine.max_num_seqs, int(kv_tokens // max(context, 1))))
    batch = 1
    for b in range(1, max_batch + 1):  # the largest batch whose step still meets the TPOT SLO
        if cost.step_time(b, b, b, b * context, int(b * context)) > config.slo_tpot_s:
            break
        batch = b
    t_step = cost.step_time(batch, batch, batch, batch * context, int(batch * context))
    decode_rate = batch / t_step
    need_p = rate * prompt / prefill_rate
    need_d = rate * output / decode_rate
    return {"rate_req_s": round(rate, 3), "prefill_tok_s_per_gpu": round(prefill_rate, 1),
            "decode_tok_s_per_gpu": round(decode_rate, 1), "decode_batch_at_tpot_slo": batch,
            "prefill_gpus": round(need_p, 3), "decode_gpus": round(need_d, 3),
            "min_gpus": max(2, math.ceil(need_p) + math.ceil(need_d))}


# ---- candidates and the recommendation -------------------------------------------------------


def splits(gpus: int, around: float | None = None, width: int = 2, colocated: bool = True,
           tp_sizes: tuple[int, ...] = (1,)) -> list[Deployment]:
    """P:D splits of ``gpus`` (all of them when few, else near ``around`` prefill GPUs plus a coarse
    grid), and the colocated deployment; with several ``tp_sizes``, each pool's workers of every
    size that fills its GPUs (``1Px4+2Dx2``)."""
    if gpus < 1:
        raise ValueError(f"need at least one GPU, got {gpus}")
    out = []
    if gpus > 1:
        if gpus <= 8 or around is None:
            prefill = set(range(1, gpus))
        else:
            centre = min(gpus - 1, max(1, round(around)))
            prefill = {p for p in range(centre - width, centre + width + 1) if 1 <= p < gpus}
            prefill |= {max(1, min(gpus - 1, round(gpus * f))) for f in (0.25, 0.5, 0.75)}
        for p in sorted(prefill):
            out += [Deployment(p // ptp, (gpus - p) // dtp, prefill_tp=ptp, decode_tp=dtp)
                    for ptp in tp_sizes for dtp in tp_sizes if p % ptp == 0 and (gpus - p) % dtp == 0]
    if colocated or gpus == 1:
        out += [Deployment(both=gpus // tp, both_tp=tp) for tp in tp_sizes if gpus % tp == 0]
    return out


def fits(deployment: Deployment, config: SimConfig) -> str | None:
    """Why ``deployment``'s workers cannot hold the model (None: they can)."""
    for role in ("prefill", "decode", "both"):
        count, tp = getattr(deployment, role), deployment.tp_of(role)
        if count:
            try:
                config.settings_for(role, tp)
                config.cost_for(tp)
            except ValueError as exc:
                return str(exc)
    return None


def rank_key(result: dict) -> tuple:
    """Best first: meets the SLOs, then fewer GPUs, then more headroom, then more goodput."""
    ratio = result.get("slo_ratio")
    return (not result["meets_slo"], result["gpus"], math.inf if ratio is None else ratio,
            -result["goodput_req_s"])


def recommend(results: list[dict]) -> dict | None:
    meeting = [r for r in results if r["meets_slo"]]
    return min(meeting, key=rank_key) if meeting else None


def search(workload: Workload, config: SimConfig, gpus: int | None = None, max_gpus: int = 64,
           budget: float = DEFAULT_BUDGET, colocated: bool = True, log=None, tp_sizes: tuple[int, ...] = (1,)
           ) -> dict:
    """Simulate candidates and recommend one.  ``gpus`` fixed: every split of that many GPUs.
    Otherwise: from the fluid bound up, until a GPU count has a split that meets the SLOs.  Each
    pool's workers may span any of ``tp_sizes`` GPUs; a deployment whose workers cannot hold the
    model is skipped (and said so)."""
    fluid = fluid_estimate(workload, config)
    share = fluid["prefill_gpus"] / max(1e-9, fluid["prefill_gpus"] + fluid["decode_gpus"])
    results: list[dict] = []

    skipped: dict[str, str] = {}

    def run(candidates: list[Deployment]) -> None:
        for d in candidates:
            problem = fits(d, config)
            if problem:
                skipped[d.label] = problem
                continue
            r = simulate(d, workload, config, budget)
            results.append(r)
            if log:
                log(f"  {d.label:>10}: TTFT p90 {_fmt(r['ttft_ms']['p90'])} ms, TPOT p90 "
                    f"{_fmt(r['tpot_ms']['p90'])} ms, goodput {r['goodput_req_s']:.3g} req/s"
                    f"{'  meets SLOs' if r['meets_slo'] else ''}  [{r['simulated']['cpu_s']:.1f} s]")

    if gpus is not None:
        run(splits(gpus, share * gpus, colocated=colocated, tp_sizes=tp_sizes))
    else:
        # One below the fluid bound: it ignores prefix-cache hits and short prompts decoded in place.
        n = max(2, fluid["min_gpus"] - 1)
        while n <= max_gpus:
            if log:
                log(f"{n} GPUs:")
            run(splits(n, share * n, width=1, colocated=colocated, tp_sizes=tp_sizes))
            if any(r["meets_slo"] and r["gpus"] == n for r in results):
                break
            n = n + 1 if n < 16 else math.ceil(n * 1.25)
    best = recommend(results)
    return {"fluid": fluid, "candidates": sorted(results, key=rank_key), "recommended": best,
            "skipped": skipped}


def _fmt(value) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.0f}"


__all__ = ["Slice", "estimate_work", "fits", "fluid_estimate", "recommend", "search", "simulate", "slice_for",
           "splits", "thin", "slo_ratio"]
