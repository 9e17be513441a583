"""Planner validation: does ``pdctl plan`` predict what the real stack measures?

    python benchmarks/planner_validation.py [--quick]

1. **Calibrate** on this machine: ``pdctl.planner.calibrate`` runs the real engine (one torch
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
   window, relative to during the probes (``pdctl.planner.live.speed_trace``).  The runs are
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
at 1,000 req/s for 10 minutes (sampled, see ``pdctl/planner/search.py``), with its CPU time and
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
from benchmarks.planner_judging import best_split_at, recorded_measurement  # noqa: E402
from benchmarks.planner_probes import (  # noqa: E402
    PROBE_SHORT, SPLITS, affinity_keys, fit_serving, predict, stack_probes,
)
from benchmarks.serving import BenchStack, prepare_model, warm_up  # noqa: E402
from launcher.local_stack import http_json  # noqa: E402
from pdctl.planner.cost_model import LinearCostModel, cost_model_from_dict  # noqa: E402
from pdctl.planner.metrics import slo_ratio  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ERROR_TARGET = 0.25  # the worst TTFT and TPOT p50 relative errors
SCALE_TARGET_S = 60.0  # the 128-GPU, 10-minute simulation's wall time
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
    from pdctl.planner.calibrate import prefill_seconds
    from pdctl.planner.traffic import LengthDist

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
    from pdctl.planner.live import fetch_steps

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
    requests (``pdctl.planner.live.fit_speeds``): each speed as the time-weighted median of the
    steps of its kind started while the other worker was idle and awake (hundreds of decode steps
    and dozens of prompt steps, where
    the request-level fits rest on three requests each: a lone stream's TPOT, the difference of a
    long and a short prompt's TTFT, which also takes in how the cost model's error differs
    between those two shapes), the per-request overhead then what the short prompt's TTFT leaves,
    and contention as how much slower a step started beside another worker's ran (a decode-only
    step beside a decode-only one apart: ``host_decode_contention``).  The request-level fits stay
    in ``overheads`` as ``*_probe``; returns the serving cost model."""
    from pdctl.planner.calibrate import request_overhead, serving_cost
    from pdctl.planner.live import fit_contention, fit_speeds

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
    probes the serving cost model was fitted to (``pdctl.planner.live.speed_trace``): the speed
    trace the replayed prediction runs with, and its summary.  ``(None, None)`` for a run recorded
    without step logs."""
    from pdctl.planner.live import speed_trace

    if not measured.get("steps"):
        return None, None
    steps = recorded_steps(measured)
    phases = measured["phases"]
    return speed_trace(steps, cost, reference=[tuple(w) for w in phases["probes"]], load=tuple(phases["load"]),
                       host=host)


def scale_run() -> dict:
    """64P+64D H200s, Llama-3-8B, chat traffic at 1,000 req/s for 600 s (the issue's scale target)."""
    from pdctl.planner.cost_model import roofline
    from pdctl.planner.hardware import GPUS, LINKS, MODELS, kv_blocks_per_gpu
    from pdctl.planner.search import simulate
    from pdctl.planner.sim_config import Deployment, EngineSettings, SimConfig
    from pdctl.planner.traffic import LengthDist, synthetic

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




def run_all(args, checkpoint: str) -> None:
    from pdctl.planner.calibrate import calibrate, host_effects, save
    from pdctl.planner.traffic import LengthDist, synthetic

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
