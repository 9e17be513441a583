"""Planner validation: does ``pdctl plan`` predict what the real stack measures?

    python benchmarks/planner_validation.py [--quick]

1. **Calibrate** on this machine: ``gateway.planner.calibrate`` runs the real engine (one torch
   thread, as each worker gets) over a grid of step shapes and fits the linear cost model.
2. **Measure**: for each split (``1P+1D`` disaggregated, ``2C`` two colocated workers; two workers
   either way, ``OMP_NUM_THREADS=1`` each, standing in for one GPU each) and each load level, start
   the real stack (``LocalStack``: Redis, gateway, workers, KV over TCP), warm it up, then probe it
   (``stack_probes``; before and after the load, averaged: the machine's speed drifts): a short
   and a long prompt and a lone stream one at a time; four streams per decoding worker together;
   a long prompt and a stream each after ``PROBE_PAUSE`` seconds of idle; a long prompt sent while
   streams decode.  From these, ``fit_serving`` fits what the stack adds to the engine right now
   -- the machine's current speed for prefill and for decode steps (it is shared: other tenants
   come and go), a per-request overhead (and, with ``--sample-overhead``, a per-streamed-token
   one), and the host effects of workers sharing two cores (``HostEffects``): how much slower a
   worker woken from idle runs, and how much a busy worker slows the others.  Every worker's
   engine logs each step (``common.engine.step_log``; read through its admin API after each
   phase), and by default (``--fit-from steps``) the speeds and the host contention come from
   the probes' steps rather than their requests (``refit_from_steps``): the prefill and decode
   speeds as the median, weighted by predicted time, of prompt and decode steps started while
   the other worker was idle and awake (a lone stream's TPOT and the difference of two prompts'
   TTFTs are three requests each),
   the per-request overhead as what the short prompt's TTFT leaves, and the host contention as
   how much slower a step started while the other worker was mid-step ran than one started
   alone -- a decode-only step beside a decode-only one apart (both stream every weight from
   memory: about 0.2 here, against 0.05 for any pairing with a prompt's chunk); ``--fit-from
   probes`` simulates the contended probe's TTFT instead.  Then the open-loop Poisson workload
   with ``benchmarks/loadgen.py`` (exact prompt and output lengths).
3. **Predict** the same runs with the simulator -- the same arrival times and lengths, the
   router's tie-breaks from the real prompts (``affinity_keys``), the same engine settings, the
   calibrated cost model with that run's fitted overheads and host effects -- and compare.
   Queueing, batching, chunking, prefill/decode interference and routing under load are what
   the simulation has to get right; per-request predictions and
   measurements are in the results file (``--repredict FILE`` predicts its runs again from the
   probes it recorded, without measuring).

4. **Replay the machine's speed** (a diagnostic).  Against the simulator's own view of each step --
   the serving cost model times the host effects of that moment, other workers mid-step and how
   long the worker had idled -- the steps tell how fast the machine ran during the load, window by
   window, relative to during the probes (``gateway.planner.live.speed_trace``).  The runs are
   predicted again with that speed replayed (``replayed`` in the JSON): what changes tells how
   much of the error is the machine's speed during the load (drift, and whatever the probes'
   fit misses about the load's steps) rather than the simulation's queueing, batching and
   routing.  The replay uses the engines' step times, never a request's TTFT or TPOT; the
   headline figures are the plain prediction's.

The last line is one JSON object with the worst relative error of the TTFT and TPOT medians over
all runs (``ttft_p50_rel_error``, ``tpot_p50_rel_error``; target <= 0.25 each); whether the split
ranked best (smallest SLO ratio: the worse of TTFT p90 / SLO and TPOT p90 / SLO) is the one that
measured best at every load level (``best_split_agrees``) -- where the measurement itself is less
than 90% sure of its best split (paired bootstrap over the requests, ``best_split_at``) the level
is a tie, which any ranking agrees with; each level says which it was --; and
``scale_sim_seconds``: the wall time of simulating 64 prefill + 64 decode H200s serving Llama-3-8B
at 1,000 req/s for 10 minutes (sampled, see ``gateway/planner/search.py``), with its CPU time and
the slice it simulated (target <= 60 s).  ``target_met``: both errors and the scale time (when
measured) within their targets; ``best_split_agrees`` is reported beside it.

Load levels: ``--quick`` 0.5 and 1 req/s; the full preset 0.3, 0.55 and 0.8 of what one prefill worker
takes by the calibration (``capacity_rate``), so a slower machine is not measured in overload.  Each
run is predicted with its own host contention when it was fitted on steps; fitted on the contended
probe (three requests) it is pooled over the runs (``--pool-contention``: the median of their fits).

On 2 shared vCPUs: ``--quick`` (tiny model, 2 load levels, 50 s each) about 15 minutes; the full
run (100m model, 3 load levels, at least 60 s and 20 requests each) about 45 minutes, 30 with
``--calibration`` reusing an earlier calibration file.  Other processes on the machine make
both the calibration and the measurement noisy; the per-run figures are in the JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks.bench_util import emit  # noqa: E402
from benchmarks.loadgen import PlannedRequest, random_ids, run_load, summarize  # noqa: E402
from benchmarks.serving import BenchStack, prepare_model, warm_up  # noqa: E402
from common.cluster.launcher import http_json  # noqa: E402
from gateway.planner.cost_model import LinearCostModel, cost_model_from_dict  # noqa: E402
from gateway.planner.metrics import slo_ratio  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ERROR_TARGET = 0.25  # the worst TTFT and TPOT p50 relative errors
SCALE_TARGET_S = 60.0  # the 128-GPU, 10-minute simulation's wall time
SPLITS = {"1P+1D": dict(prefill=1, decode=1, both=0), "2C": dict(prefill=0, decode=0, both=2)}
PRESETS = {
    "quick": dict(model="tiny", rates=(0.5, 1.0), duration=50.0, prompt_len="uniform:64:512",
                  output_len="uniform:16:48", slo_ttft=2.0, slo_tpot=0.1),
    # The full preset's load levels are fractions of what one prefill worker can take on this machine
    # (``capacity_rate``), so a slower machine is not measured deep in overload, where a queue grows
    # for as long as the run lasts and its median says more about the run's length than the stack.
    "full": dict(model="100m", loads=(0.3, 0.55, 0.8), duration=60.0, min_requests=20,
                 prompt_len="uniform:64:768", output_len="uniform:16:64", slo_ttft=3.0, slo_tpot=0.2),
}


def capacity_rate(engine_cost, prompt_len: str, chunk: int) -> float:
    """Requests per second one worker can prefill, by the calibrated engine: 1 / the mean time to
    compute a prompt of the distribution's lengths in chunks of ``chunk`` tokens."""
    from gateway.planner.calibrate import prefill_seconds
    from gateway.planner.traffic import LengthDist

    lengths, counts = np.unique(LengthDist.parse(prompt_len).sample(np.random.default_rng(0), 4096),
                                return_counts=True)
    mean = float(np.average([prefill_seconds(engine_cost, int(n), chunk)[0] for n in lengths], weights=counts))
    return 1.0 / mean


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def real_plan(workload, vocab: int, seed: int) -> list[PlannedRequest]:
    """The workload as loadgen requests: same times and lengths, real random token ids."""
    import random

    rng = random.Random(f"load-{seed}")
    return [PlannedRequest(random_ids(rng, int(workload.prompt_len[i]), vocab), int(workload.output_len[i]),
                           float(workload.arrival[i]), "planned") for i in range(len(workload))]


def worker_steps(stack, since: float) -> dict[str, np.ndarray]:
    """Every worker's engine steps that ended after ``since`` (unix time), from its step log."""
    from gateway.planner.live import fetch_steps

    out = {}
    for name in stack.procs:
        if name != "gateway":
            # The workers' admin API, signed for each (workers take no admin token).
            out[name], _ = fetch_steps(lambda after: stack.worker_json(name, f"/admin/steps?since={after!r}"), since)
    return out


def measure(split: str, checkpoint: str, plan, args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"pdserve-planval-{split}-"))
    worker_args = ["--block-size", str(args.block_size), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                   "--num-blocks", str(args.num_blocks), "--max-num-seqs", str(args.max_num_seqs)]
    stack = BenchStack(checkpoint, args.redis_url, key_prefix=f"bench-planval-{uuid.uuid4().hex[:10]}",
                       workdir=workdir, transport="tcp", policy="prefix_aware", worker_args=worker_args,
                       extra_env={"OMP_NUM_THREADS": "1"}, **SPLITS[split])
    try:
        stack.start(timeout=600)
        model = http_json(f"{stack.gateway_url}/v1/models")["data"][0]["id"]
        vocab = args.vocab
        # Token streams of their own (as the probes' and each load's are): a warm-up prompt drawn
        # from a load's seed would put that load's first prompt in the prefix cache.
        warm = [PlannedRequest(random_ids(__import__("random").Random("warmup-short"), 48, vocab), 4, 0.0, "warmup"),
                PlannedRequest(random_ids(__import__("random").Random("warmup-long"), 400, vocab), 4, 0.0, "warmup")]
        asyncio.run(warm_up(stack.gateway_url, model, warm))
        decoders = SPLITS[split]["decode"] + SPLITS[split]["both"]
        # Each phase's steps are read right after it (a step log keeps its last 16k steps).
        marks = [time.time()]
        before = asyncio.run(stack_probes(stack.gateway_url, model, args, decoders, seed=4242))
        phases = [worker_steps(stack, marks[-1])]
        marks.append(time.time())
        records, wall = asyncio.run(run_load(stack.gateway_url, model, plan, timeout=600))
        marks.append(time.time())
        phases.append(worker_steps(stack, marks[-2]))
        after = asyncio.run(stack_probes(stack.gateway_url, model, args, decoders, seed=4243))
        marks.append(time.time())
        phases.append(worker_steps(stack, marks[-2]))
    finally:
        stack.stop()
    summary = summarize(records, wall, args.slo_ttft, args.slo_tpot)
    # The machine's speed drifts (other tenants): probes on both sides of the load, averaged.
    summary["probes"] = {key: 0.5 * (before[key] + after[key]) for key in before}
    summary["probes_before_after"] = {key: [round(before[key], 6), round(after[key], 6)] for key in before}
    summary["per_request"] = [(r.ttft, r.tpot) if r.ok else (None, None) for r in records]
    summary["model_id"] = model
    # The engines' steps (wall-clock time ended, seconds, shape): how fast the machine ran in each
    # phase, for the prediction that replays it (``speed_replay``).
    summary["steps"] = {name: np.round(np.vstack([phase[name] for phase in phases]), 6).tolist()
                        for name in phases[0]}
    summary["phases"] = {"probes": [marks[0:2], marks[2:4]], "load": marks[1:3]}
    return summary


def recorded_steps(measured: dict) -> dict[str, np.ndarray]:
    """A run's recorded step logs as arrays of ``common.engine.step_log.COLUMNS`` rows, by worker."""
    from common.engine.step_log import COLUMNS

    return {name: np.asarray(rows, dtype=float).reshape(-1, len(COLUMNS)) for name, rows in measured["steps"].items()}


def refit_from_steps(engine_cost, measured: dict, overheads: dict, args):
    """Fit the engine speeds and the host contention on the probes' engine steps instead of their
    requests (``gateway.planner.live.fit_speeds``): each speed as the time-weighted median of the
    steps of its kind started while the other worker was idle and awake (hundreds of decode steps
    and dozens of prompt steps, where
    the request-level fits rest on three requests each: a lone stream's TPOT, the difference of a
    long and a short prompt's TTFT, which also takes in how the cost model's error differs
    between those two shapes), the per-request overhead then what the short prompt's TTFT leaves,
    and contention as how much slower a step started beside another worker's ran (a decode-only
    step beside a decode-only one apart: ``host_decode_contention``).  The request-level fits stay
    in ``overheads`` as ``*_probe``; returns the serving cost model."""
    from gateway.planner.calibrate import request_overhead, serving_cost
    from gateway.planner.live import fit_contention, fit_speeds

    steps, windows = recorded_steps(measured), [tuple(w) for w in measured["phases"]["probes"]]
    speeds = fit_speeds(steps, engine_cost, windows)
    if speeds["decode"] is not None:
        overheads["decode_speed_probe"], overheads["decode_speed"] = overheads["decode_speed"], speeds["decode"]
    if speeds["prefill"] is not None:
        overheads["speed_probe"], overheads["speed"] = overheads["speed"], speeds["prefill"]
        overheads["request_overhead_s_probe"] = overheads["request_overhead_s"]
        overheads["request_overhead_s"] = request_overhead(
            engine_cost, ttft_short_s=measured["probes"]["ttft_short_s"], short_len=PROBE_SHORT,
            chunk=args.max_num_batched_tokens, speed=speeds["prefill"],
            sample_overhead_s=overheads["sample_overhead_s"])
    cost = serving_cost(engine_cost, overheads)
    contention = fit_contention(steps, cost, windows)
    if contention["contention"] is not None:
        overheads["host_contention_probe"], overheads["host_contention"] = (overheads["host_contention"],
                                                                            contention["contention"])
    if contention["decode_contention"] is not None:
        overheads["host_decode_contention"] = contention["decode_contention"]
    return cost


def speed_replay(measured: dict, cost, host) -> tuple[object, dict] | tuple[None, None]:
    """The machine's speed during a run's load, window by window, relative to its speed during the
    probes the serving cost model was fitted to (``gateway.planner.live.speed_trace``): the speed
    trace the replayed prediction runs with, and its summary.  ``(None, None)`` for a run recorded
    without step logs."""
    from gateway.planner.live import speed_trace

    if not measured.get("steps"):
        return None, None
    steps = recorded_steps(measured)
    phases = measured["phases"]
    return speed_trace(steps, cost, reference=[tuple(w) for w in phases["probes"]], load=tuple(phases["load"]),
                       host=host)


# The short probe is above the gateway's skip-prefill threshold (64): disaggregated, both probes take the
# remote path, so the fixed cost of that path lands in the per-request overhead, not in the speed.
PROBE_SHORT, PROBE_LONG, PROBE_STREAM = 80, 512, 48
PROBE_BATCH = 4  # streams per decoding worker in the batched and the contended probes
PROBE_PAUSE = 2.0  # seconds idle before each cold probe
COLD_STREAM_PROMPT = 256
CONTENDED_STREAM, CONTENDED_DELAY = 128, 0.1  # the contended probe's streams, and when its prompt follows them


def contended_plan(decoders: int) -> list[tuple[float, int, int]]:
    """The contended probe as (send time, prompt tokens, output tokens): ``PROBE_BATCH`` streams per
    decoding worker, then a long prompt while they decode."""
    return [(0.0, PROBE_SHORT, CONTENDED_STREAM)] * (PROBE_BATCH * decoders) + [(CONTENDED_DELAY, PROBE_LONG, 2)]


async def stack_probes(url: str, model: str, args, decoders: int, seed: int, repeats: int = 3) -> dict:
    """Requests that show how the stack runs the engine, each a median of ``repeats``:

    - one at a time, back to back: the TTFT of a short and a long prompt and the TPOT of a lone stream;
    - ``PROBE_BATCH`` streams per decoding worker started together: their median TPOT;
    - after ``PROBE_PAUSE`` seconds of idle each (waking up): the long prompt's TTFT, and the TPOT of
      a stream with a ``COLD_STREAM_PROMPT``-token prompt (computed just before, as in the load);
    - the contended probe (``contended_plan``): the long prompt's TTFT while the streams decode, and
      the streams' median TPOT (their decode steps beside -- colocated, with -- its chunks)."""
    import random
    import statistics

    rng = random.Random(f"probes-{seed}")  # each call its own prompts: no prefix cache hit on an earlier call's

    async def send(plan: list[tuple[float, int, int]]):
        records, _ = await run_load(url, model, [PlannedRequest(random_ids(rng, prompt, args.vocab), tokens, at, "probe")
                                                 for at, prompt, tokens in plan])
        failed = [r.error for r in records if not r.ok]
        if failed:
            raise RuntimeError(f"probe request failed: {failed[0]}")
        return records

    out = {}
    for name, prompt, tokens in (("ttft_short_s", PROBE_SHORT, 2), ("ttft_long_s", PROBE_LONG, 2),
                                 ("tpot_s", PROBE_SHORT, PROBE_STREAM)):
        values = [(await send([(0.0, prompt, tokens)]))[0] for _ in range(repeats)]
        out[name] = statistics.median(r.tpot if name == "tpot_s" else r.ttft for r in values)
    values = []
    for _ in range(repeats):
        records = await send([(0.0, PROBE_SHORT, PROBE_STREAM)] * (PROBE_BATCH * decoders))
        values.append(statistics.median(r.tpot for r in records))
    out["tpot_batch_s"] = statistics.median(values)
    prompts, streams = [], []
    for _ in range(repeats):
        await asyncio.sleep(PROBE_PAUSE)
        prompts.append((await send([(0.0, PROBE_LONG, 2)]))[0].ttft)
        await asyncio.sleep(PROBE_PAUSE)
        streams.append((await send([(0.0, COLD_STREAM_PROMPT, PROBE_STREAM)]))[0].tpot)
    out["ttft_long_cold_s"], out["tpot_cold_s"] = statistics.median(prompts), statistics.median(streams)
    prompts, streams = [], []
    for _ in range(repeats):
        records = await send(contended_plan(decoders))
        prompts.append(records[-1].ttft)
        streams.append(statistics.median(r.tpot for r in records[:-1]))
    out["ttft_contended_s"], out["tpot_contended_s"] = statistics.median(prompts), statistics.median(streams)
    return out


def simulate_probe(split: str, cost, args, overhead_s: float, host) -> tuple[float, float]:
    """The contended probe as the simulator predicts it: the long prompt's TTFT and the streams'
    median TPOT."""
    from gateway.planner.traffic import Workload

    decoders = SPLITS[split]["decode"] + SPLITS[split]["both"]
    plan = contended_plan(decoders)
    workload = Workload(np.array([p[0] for p in plan]), np.array([p[1] for p in plan]), np.array([p[2] for p in plan]))
    _, sim = simulation(split, workload, cost, args, overhead_s, host)
    first, finish = np.asarray(sim.first_token[:-1]), np.asarray(sim.finish[:-1])
    streams_tpot = float(np.median((finish - first) / (workload.output_len[:-1] - 1)))
    return sim.first_token[-1] - workload.arrival[-1], streams_tpot


def fit_serving(engine_cost, probes: dict, split: str, args):
    """What the stack adds to the calibrated engine, fitted from ``split``'s probes: the overheads
    and host effects (the ``serving`` section of a calibration file; ``host_effects`` reads the
    latter) and the serving cost model."""
    from gateway.planner.calibrate import (
        cold_slowdowns, fit_host_effects, fit_stack_overheads, serving_cost,
    )
    from gateway.planner.sim_config import HostEffects

    overheads = fit_stack_overheads(engine_cost, short_len=PROBE_SHORT, long_len=PROBE_LONG,
                                    chunk=args.max_num_batched_tokens, decode_context=PROBE_SHORT + PROBE_STREAM // 2,
                                    batch=PROBE_BATCH if args.sample_overhead else 1,
                                    **{k: probes[k] for k in ("ttft_short_s", "ttft_long_s", "tpot_s", "tpot_batch_s")})
    cost = serving_cost(engine_cost, overheads)
    prefill_cold, decode_cold = cold_slowdowns(
        engine_cost, ttft_long_s=probes["ttft_long_s"], ttft_long_cold_s=probes["ttft_long_cold_s"],
        request_overhead_s=overheads["request_overhead_s"], tpot_s=probes["tpot_s"], tpot_cold_s=probes["tpot_cold_s"],
        decode_context=PROBE_SHORT + PROBE_STREAM // 2, cold_decode_context=COLD_STREAM_PROMPT + PROBE_STREAM // 2)
    overheads.update(fit_host_effects(
        cold_prefill_slowdown=prefill_cold, cold_decode_slowdown=decode_cold, pause_s=PROBE_PAUSE,
        contended_ttft_s=probes["ttft_contended_s"],
        predict_contended=lambda c: simulate_probe(split, cost, args, overheads["request_overhead_s"],
                                                   HostEffects(contention=c))[0]))
    overheads["cold_slowdowns"] = [round(prefill_cold, 4), round(decode_cold, 4)]
    if "tpot_contended_s" in probes:  # how the fitted simulation does on the contended streams (a check)
        _, streams = simulate_probe(split, cost, args, overheads["request_overhead_s"],
                                    HostEffects(contention=overheads["host_contention"]))
        overheads["contended_streams_tpot_s"] = [round(streams, 5), round(probes["tpot_contended_s"], 5)]
    return overheads, cost


def affinity_keys(plan: list[PlannedRequest], model_id: str, block_size: int) -> list[bytes]:
    """Each planned request's key for the router's tie-break, as the gateway computes it: the
    hash of the real prompt's first block (``b""`` for a prompt shorter than a block).  With
    these and the stack's worker names, the simulated router breaks a tie between equally loaded
    workers -- two idle colocated workers: compute the prompt where it decodes or on the other
    one -- as the real one did, instead of by a hash of the simulation's own tokens."""
    from common.engine.prefix_hash import block_extra_keys, hash_prompt_blocks

    extra = block_extra_keys(model_id)
    return [hash_prompt_blocks(r.prompt[:block_size], block_size, extra)[0] if len(r.prompt) >= block_size else b""
            for r in plan]


def simulation(split: str, workload, cost, args, overhead_s: float, host, speed=None, affinity=None):
    """Runs the simulator on ``workload`` as the stack was set up (``speed``: a ``SpeedTrace`` to
    replay; ``affinity``: ``affinity_keys`` of the real requests); returns its result and itself."""
    from gateway.planner.hardware import LinkProfile
    from gateway.planner.sim_config import Deployment, EngineSettings, SimConfig
    from gateway.planner.simulator import Simulation

    engine = EngineSettings(num_blocks=args.num_blocks, block_size=args.block_size,
                            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                            max_model_len=args.max_model_len)
    config = SimConfig(cost=cost, engine=engine, link=LinkProfile("tcp-loopback", 1e9, 2e-4),
                       kv_bytes_per_token=args.kv_bytes_per_token, slo_ttft_s=args.slo_ttft,
                       slo_tpot_s=args.slo_tpot, overhead_s=overhead_s, host=host, speed=speed)
    sim = Simulation(Deployment(**SPLITS[split]), workload, config, affinity_keys=affinity)
    return sim.run(), sim


def predict(split: str, workload, cost, args, overhead_s: float, host, speed=None, affinity=None) -> dict:
    result, sim = simulation(split, workload, cost, args, overhead_s, host, speed, affinity)
    first, finish = np.asarray(sim.first_token), np.asarray(sim.finish)
    tpot = (finish - first) / np.maximum(workload.output_len - 1, 1)
    result["per_request"] = list(zip((first - workload.arrival).tolist(), tpot.tolist()))
    # Where each prompt was computed: "local@b0" where it decodes, "remote@b1" on another worker.
    result["routes"] = [f"{kind}@{worker}" for kind, worker in zip(sim.route_kind, sim.computed_by)]
    return result


def scale_run() -> dict:
    """64P+64D H200s, Llama-3-8B, chat traffic at 1,000 req/s for 600 s (the issue's scale target)."""
    from gateway.planner.cost_model import roofline
    from gateway.planner.hardware import GPUS, LINKS, MODELS, kv_blocks_per_gpu
    from gateway.planner.search import simulate
    from gateway.planner.sim_config import Deployment, EngineSettings, SimConfig
    from gateway.planner.traffic import LengthDist, synthetic

    spec = MODELS["llama-3-8b"]
    began_wall, began_cpu = time.perf_counter(), time.process_time()
    workload = synthetic(1000.0, 600.0, LengthDist.parse("loguniform:128:2048"), LengthDist.parse("loguniform:32:512"),
                         seed=0, max_model_len=spec.max_model_len)
    engine = EngineSettings(num_blocks=kv_blocks_per_gpu(GPUS["H200"], spec, 16), max_num_batched_tokens=8192,
                            max_num_seqs=256, max_model_len=spec.max_model_len)
    config = SimConfig(cost=roofline("H200", spec), engine=engine, link=LINKS["nvlink4"],
                       kv_bytes_per_token=spec.kv_bytes_per_token, slo_ttft_s=2.0, slo_tpot_s=0.05)
    result = simulate(Deployment(64, 64), workload, config)
    return {"scale_sim_seconds": round(time.perf_counter() - began_wall, 2),
            "scale_sim_cpu_seconds": round(time.process_time() - began_cpu, 2),
            "scale_requests": len(workload), "scale_simulated": result["simulated"],
            "scale_ttft_p90_ms": result["ttft_ms"]["p90"], "scale_tpot_p90_ms": result["tpot_ms"]["p90"],
            "scale_goodput_req_s": result["goodput_req_s"]}


def _ms(seconds) -> float | None:
    return None if seconds is None or not np.isfinite(seconds) else round(seconds * 1e3, 3)


def rel(pred, meas) -> float | None:
    if pred is None or meas is None or meas <= 0 or pred == float("inf"):
        return None
    return abs(pred - meas) / meas


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--model")
    p.add_argument("--rates", help="comma-separated req/s (default: the preset's)")
    p.add_argument("--loads", help="comma-separated fractions of one prefill worker's calibrated capacity, "
                                   "instead of --rates")
    p.add_argument("--duration", type=float, help="seconds of traffic per run, at least")
    p.add_argument("--min-requests", type=int, help="make each run long enough for this many requests on "
                                                    "average (the full preset: 20)")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--calibration", type=Path, help="reuse a calibration file instead of measuring")
    p.add_argument("--skip-scale", action="store_true", help="leave out the 128-GPU simulation")
    p.add_argument("--repredict", type=Path, metavar="RESULTS",
                   help="measure nothing: predict the runs of a results file again from the probes it recorded "
                        "(with --calibration and the flags it was measured with), e.g. after a model change")
    p.add_argument("--sample-overhead", action=argparse.BooleanOptionalAction, default=False,
                   help="fit a per-token serving overhead and the decode speed from both decode probes (else "
                        "the decode speed from the lone stream; the batched probe is recorded either way)")
    p.add_argument("--pool-contention", action=argparse.BooleanOptionalAction, default=None,
                   help="predict every run with the median of the runs' fitted host contention, else each "
                        "run's own fit (default: pooled with --fit-from probes, where each run's fit rests on "
                        "three requests; each run's own from its steps, hundreds of them)")
    p.add_argument("--fit-from", choices=("steps", "probes"), default="steps",
                   help="fit the engine speeds and host contention from the probes' engine steps (their step "
                        "logs), or from the probe requests alone (two prompts' TTFTs, a lone stream's TPOT; "
                        "simulating the contended probe's TTFT)")
    p.add_argument("--real-affinity", action=argparse.BooleanOptionalAction, default=True,
                   help="break the simulated router's ties with the real prompts' first-block hashes, as the "
                        "gateway does (else with the simulation's own tokens: an unrelated coin flip)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    preset = PRESETS["quick" if args.quick else "full"]
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if isinstance(args.rates, str):
        args.rates, args.loads = [float(r) for r in args.rates.split(",")], None
    elif isinstance(args.loads, str):
        args.loads = [float(x) for x in args.loads.split(",")]
    checkpoint, args.vocab = prepare_model(args.model)
    RESULTS.mkdir(parents=True, exist_ok=True)

    run_all(args, checkpoint)


CONFIDENCE = 0.9  # how sure the measurement must be of its best split for a disagreement to count


def best_split_at(rate: float, runs: list[dict], args, seed: int = 0, resamples: int = 2000,
                  prediction: str = "predicted") -> dict:
    """The split the planner ranks best at one load level (smallest predicted SLO ratio) against the
    one measured best, and how sure the measurement is of it: the share of paired bootstrap
    resamples of the requests (every split served the same ones) in which it is still best.
    Under ``CONFIDENCE`` the measurement cannot tell the splits apart: a tie, which any
    prediction agrees with.  Reported, so a tie is never mistaken for an agreement."""
    from gateway.planner.metrics import percentile

    def ratio(ttft_s: np.ndarray, tpot_s: np.ndarray) -> float:
        tpot = tpot_s[np.isfinite(tpot_s)]
        return slo_ratio(percentile(ttft_s, 90), percentile(tpot, 90) if len(tpot) else float("nan"),
                         args.slo_ttft, args.slo_tpot)

    def measured(run: dict, key: str) -> np.ndarray:
        return np.array([np.inf if q[key][1] is None else q[key][1] / 1e3 for q in run["per_request"]])

    pred_best = min(runs, key=lambda r: r[prediction]["slo_ratio"] if r[prediction]["slo_ratio"] is not None
                    else float("inf"))["split"]
    meas_best = min(runs, key=lambda r: r["measured"]["slo_ratio"])["split"]
    samples = {r["split"]: (measured(r, "ttft_ms"), measured(r, "tpot_ms")) for r in runs}
    n = min(len(ttft) for ttft, _ in samples.values())
    rng = np.random.default_rng(seed)
    wins = 0
    for _ in range(resamples):
        pick = rng.integers(0, n, n)
        ratios = {split: ratio(ttft[pick], tpot[pick]) for split, (ttft, tpot) in samples.items()}
        wins += min(ratios, key=ratios.get) == meas_best
    confidence = wins / resamples
    return {"rate": rate, "predicted_best": pred_best, "measured_best": meas_best,
            "measured_confidence": round(confidence, 3), "tie": confidence < CONFIDENCE,
            "agrees": pred_best == meas_best or confidence < CONFIDENCE,
            "slo_ratio": {r["split"]: {"predicted": r[prediction]["slo_ratio"],
                                       "measured": round(r["measured"]["slo_ratio"], 4)} for r in runs}}


def recorded_measurement(runs: list[dict], split: str, rate: float, requests: int) -> dict:
    """A run's measurement as a results file recorded it (``--repredict``)."""
    for run in runs:
        if run["split"] == split and run["rate"] == rate and run["requests"] == requests:
            return {**run["measured"], "probes": run["probes"], "probes_before_after": run.get("probes_before_after"),
                    "steps": run.get("steps"), "phases": run.get("phases"), "model_id": run.get("model_id"),
                    "per_request": [tuple(None if q[key][1] is None else q[key][1] / 1e3 for key in ("ttft_ms", "tpot_ms"))
                                    for q in run["per_request"]]}
    raise SystemExit(f"the results file has no {split} run at {rate} req/s of {requests} requests: "
                     "give the flags it was measured with")


def run_all(args, checkpoint: str) -> None:
    from gateway.planner.calibrate import calibrate, host_effects, save
    from gateway.planner.traffic import LengthDist, synthetic

    if args.calibration:
        document = json.loads(args.calibration.read_text())
    else:
        log(f"calibrating on {checkpoint} (1 thread)...")
        document = calibrate(checkpoint, threads=1, block_size=args.block_size,
                             max_num_batched_tokens=args.max_num_batched_tokens, quick=True, log=log)
        save(document, RESULTS / f"planner-calibration{'-quick' if args.quick else ''}.json")
    engine_cost = cost_model_from_dict(document["cost_model"])
    assert isinstance(engine_cost, LinearCostModel)
    log(engine_cost.describe() + f"; fit {engine_cost.fit.get('median_rel_error')} median rel error")
    args.kv_bytes_per_token = document["engine"]["kv_bytes_per_token"]
    args.max_model_len = document["engine"]["max_model_len"]

    if args.loads:
        capacity = capacity_rate(engine_cost, args.prompt_len, args.max_num_batched_tokens)
        rates = [round(load * capacity, 3) for load in args.loads]
        log(f"one prefill worker takes {capacity:.3f} req/s of {args.prompt_len} prompts (calibrated engine): "
            f"load levels {list(args.loads)} -> {rates} req/s")
    else:
        capacity, rates = None, list(args.rates)
    runs, fitted = [], []
    recorded = json.loads(args.repredict.read_text())["runs"] if args.repredict else None
    for level, rate in enumerate(rates):
        duration = max(args.duration, (args.min_requests or 0) / rate)
        workload = synthetic(rate, duration, LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len),
                             seed=args.seed + level)
        plan = real_plan(workload, args.vocab, args.seed + level)
        for split in SPLITS:
            if recorded is not None:
                measured = recorded_measurement(recorded, split, rate, len(plan))
            else:
                log(f"[{split} @ {rate} req/s] measuring {len(plan)} requests...")
                measured = measure(split, checkpoint, plan, args)
            overheads, cost = fit_serving(engine_cost, measured["probes"], split, args)
            if args.fit_from == "steps" and measured.get("steps"):
                cost = refit_from_steps(engine_cost, measured, overheads, args)
            if args.real_affinity:  # a file recorded without the model id: the gateway's default, the checkpoint's name
                measured["affinity"] = affinity_keys(plan, measured.get("model_id") or Path(checkpoint).name,
                                                     args.block_size)
            fitted.append((rate, split, workload, measured, overheads, cost))
    if args.pool_contention is None:
        args.pool_contention = args.fit_from == "probes"
    if args.pool_contention:
        # How much busy workers slow each other is the host's, not one run's: each run's contended
        # probe is three requests on a machine whose speed drifts, so every run uses the runs' median.
        pooled = float(np.median([overheads["host_contention"] for *_, overheads, _ in fitted]))
        for *_, overheads, _ in fitted:
            overheads["host_contention_run"], overheads["host_contention"] = overheads["host_contention"], pooled
        log(f"host contention: {pooled:.3f} per busy worker (the median of the runs' fits)")
    for rate, split, workload, measured, overheads, cost in fitted:
        host = host_effects(overheads)
        affinity = measured.get("affinity")
        predicted = predict(split, workload, cost, args, overheads["request_overhead_s"], host, affinity=affinity)
        log(f"[{split} @ {rate} req/s] idle stack: prefill x{overheads['speed']:.2f}, decode "
            f"x{overheads['decode_speed']:.2f}, {overheads['sample_overhead_s'] * 1e3:.2f} ms/token streamed, "
            f"{overheads['request_overhead_s'] * 1e3:.0f} ms/request, cold x{1 + overheads['wake_slowdown']:.2f} "
            f"(prefill x{1 + overheads['cold_slowdowns'][0]:.2f}, decode x{1 + overheads['cold_slowdowns'][1]:.2f}), "
            f"contention {overheads['host_contention']:.2f} per busy worker")
        log(f"[{split} @ {rate} req/s] predicted TTFT p50 {predicted['ttft_ms']['p50']} ms, "
            f"TPOT p50 {predicted['tpot_ms']['p50']} ms")
        log(f"[{split} @ {rate} req/s] measured  TTFT p50 {measured['ttft_ms']['p50']} ms, "
            f"TPOT p50 {measured['tpot_ms']['p50']} ms, errors {measured['errors']}")
        trace, speed = speed_replay(measured, cost, host)
        replayed = None if trace is None else predict(split, workload, cost, args, overheads["request_overhead_s"],
                                                      host, trace, affinity)
        if replayed is not None:
            replayed.pop("per_request")
            log(f"[{split} @ {rate} req/s] engines during the load x{speed['prefill']:.2f} (prefill) "
                f"x{speed['decode']:.2f} (decode) of their speed in the probes; replayed: TTFT p50 "
                f"{replayed['ttft_ms']['p50']} ms, TPOT p50 {replayed['tpot_ms']['p50']} ms")
        per_request = [{"prompt": int(workload.prompt_len[i]), "output": int(workload.output_len[i]),
                        "arrival_s": round(float(workload.arrival[i]), 4),
                        "ttft_ms": [_ms(p[0]), _ms(m[0])], "tpot_ms": [_ms(p[1]), _ms(m[1])],
                        "predicted_route": route}
                       for i, (p, m, route) in enumerate(zip(predicted.pop("per_request"), measured.pop("per_request"),
                                                             predicted.pop("routes")))]
        runs.append({"split": split, "rate": rate, "requests": len(workload), "stack": overheads,
                     "probes": measured.pop("probes"), "probes_before_after": measured.get("probes_before_after"),
                     "per_request": per_request,
                     "predicted": {k: predicted[k] for k in ("ttft_ms", "tpot_ms", "itl_ms", "goodput_req_s",
                                                             "slo_ratio", "preemptions")},
                     "measured": {k: measured[k] for k in ("ttft_ms", "tpot_ms", "itl_ms", "goodput_req_s",
                                                           "errors")},
                     "ttft_p50_rel_error": rel(predicted["ttft_ms"]["p50"], measured["ttft_ms"]["p50"]),
                     "tpot_p50_rel_error": rel(predicted["tpot_ms"]["p50"], measured["tpot_ms"]["p50"]),
                     "speed_replay": speed, "steps": measured.get("steps"), "phases": measured.get("phases"),
                     "model_id": measured.get("model_id")})
        if replayed is not None:
            runs[-1].update(
                replayed={k: replayed[k] for k in ("ttft_ms", "tpot_ms", "goodput_req_s", "slo_ratio")},
                replayed_ttft_p50_rel_error=rel(replayed["ttft_ms"]["p50"], measured["ttft_ms"]["p50"]),
                replayed_tpot_p50_rel_error=rel(replayed["tpot_ms"]["p50"], measured["tpot_ms"]["p50"]))
        m = runs[-1]["measured"]
        m["slo_ratio"] = slo_ratio((m["ttft_ms"]["p90"] or float("inf")) / 1e3,
                                   (m["tpot_ms"]["p90"] or float("nan")) / 1e3, args.slo_ttft, args.slo_tpot)

    agree = [best_split_at(rate, [r for r in runs if r["rate"] == rate], args, seed=args.seed) for rate in rates]

    def worst(key):
        values = [r.get(key) for r in runs]
        return None if any(v is None for v in values) else round(max(values), 4)

    line = {"benchmark": "planner_validation", "quick": args.quick, "model": args.model,
            "ttft_p50_rel_error": worst("ttft_p50_rel_error"), "tpot_p50_rel_error": worst("tpot_p50_rel_error"),
            "best_split_agrees": all(a["agrees"] for a in agree),
            "rates": rates, "loads": list(args.loads) if args.loads else None,
            "capacity_req_s": None if capacity is None else round(capacity, 4),
            "best_split": agree, "target": ERROR_TARGET,
            # The same runs predicted again with the engines' speed during each load replayed from
            # their step logs (``speed_replay``): what is left is the simulation's own error.
            "replayed": None if not all("replayed" in r for r in runs) else {
                "ttft_p50_rel_error": worst("replayed_ttft_p50_rel_error"),
                "tpot_p50_rel_error": worst("replayed_tpot_p50_rel_error"),
                "best_split_agrees": all(best_split_at(rate, [r for r in runs if r["rate"] == rate], args,
                                                       seed=args.seed, prediction="replayed")["agrees"]
                                         for rate in rates),
                "engine_speed": [[r["split"], r["rate"], r["speed_replay"]["prefill"], r["speed_replay"]["decode"]]
                                 for r in runs]},
            "calibration_fit": {k: engine_cost.fit.get(k) for k in ("median_rel_error", "p90_rel_error")},
            "runs": [{"split": r["split"], "rate": r["rate"],
                      "ttft_p50_ms": [r["predicted"]["ttft_ms"]["p50"], r["measured"]["ttft_ms"]["p50"]],
                      "tpot_p50_ms": [r["predicted"]["tpot_ms"]["p50"], r["measured"]["tpot_ms"]["p50"]],
                      "replayed_p50_ms": [r["replayed"]["ttft_ms"]["p50"], r["replayed"]["tpot_ms"]["p50"]]
                      if "replayed" in r else None,
                      "stack": r["stack"], "errors": r["measured"]["errors"]} for r in runs]}
    if not args.skip_scale:
        log("simulating 64P+64D H200s at 1,000 req/s for 600 s...")
        line.update(scale_run())
    line["target_met"] = bool(line["ttft_p50_rel_error"] is not None and line["ttft_p50_rel_error"] <= ERROR_TARGET
                              and line["tpot_p50_rel_error"] is not None and line["tpot_p50_rel_error"] <= ERROR_TARGET
                              and line.get("scale_sim_seconds", 0.0) <= SCALE_TARGET_S)
    out = RESULTS / f"planner-validation{'-quick' if args.quick else ''}{'-repredicted' if args.repredict else ''}.json"
    out.write_text(json.dumps({"line": line, "runs": runs}, indent=2, default=str))
    log(f"wrote {out}")
    emit(line)


if __name__ == "__main__":
    def on_term(_sig, _frame):
        raise KeyboardInterrupt  # unwinds through every stack.stop()

    signal.signal(signal.SIGTERM, on_term)
    main()
