"""``pdctl plan`` and ``pdctl calibrate``: flags, and turning them into a simulation.

    pdctl calibrate [--model M] [--threads N] --out calibration.json
    pdctl calibrate --live [--window 600] --out calibration.json    (a running deployment's steps)
    pdctl plan --model llama-3-8b --gpu H200 --rate 20 --prompt-len ... --slo-ttft 1 --slo-tpot 0.05
    pdctl plan --calibration calibration.json --model CHECKPOINT --gpus 2 ...
    pdctl plan ... --trace mooncake.jsonl

The last line ``pdctl plan`` prints is one JSON object (the recommendation and every candidate);
``--out`` writes the whole plan as JSON and the plot next to it as PNG.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from common.engine.config import (
    KV_CACHE_DTYPES, EngineConfig, SchedulerConfig, SchedulingDefaults, batch_limits, scheduling_defaults,
)
from pdctl.planner.cost_model import load_cost_model, roofline
from pdctl.planner.hardware import GPUS, LINKS, MODELS, kv_blocks_per_gpu, load_model_spec, parse_link
from pdctl.planner.sim_config import DEFAULT_BUDGET, Deployment, EngineSettings, HostEffects, SimConfig
from pdctl.planner.traffic import LengthDist, load_trace, synthetic
from gateway.routing import POLICIES, RoutingConfig

EPILOG = __doc__.split("\n\n", 1)[1]


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="simulate deployments on the real scheduler and router; recommend the cheapest "
                       "that meets the SLOs", description=__doc__.split("\n\n")[0], epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_traffic_args(p)
    g = p.add_argument_group("SLOs")
    g.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT p90 target, seconds (default %(default)s)")
    g.add_argument("--slo-tpot", type=float, default=0.1, help="TPOT p90 target, seconds (default %(default)s)")
    g = p.add_argument_group("deployments to compare (default: search up from the fluid bound)")
    g.add_argument("--gpus", type=int, help="compare every P:D split of this many GPUs, and colocated")
    g.add_argument("--max-gpus", type=int, default=64, help="search limit (default %(default)s)")
    g.add_argument("--split", action="append", default=[],
                   help="a deployment to simulate, P:D or colocated:N, each count optionally xTP (workers of TP "
                        "GPUs: 1x4:2x2 is one prefill worker of 4 GPUs and two decode workers of 2); repeatable, "
                        "replaces the search")
    g.add_argument("--tp-sizes", default="1",
                   help="GPUs per worker the search may give each pool, e.g. 1,2,4,8 (tensor parallelism, --gpu "
                        "only; default %(default)s)")
    g.add_argument("--no-colocated", action="store_true", help="leave colocated deployments out")
    add_engine_args(p)
    g = p.add_argument_group("run")
    g.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                   help="request-steps simulated per deployment before sampling a slice (default %(default)g)")
    g.add_argument("--out", type=Path, help="write the plan as JSON here and the plot next to it (.png)")
    g.add_argument("--quiet", action="store_true", help="only the JSON line")
    p.set_defaults(func=cmd_plan)


def add_model_args(p) -> None:
    g = p.add_argument_group("model and hardware")
    g.add_argument("--model", default="llama-3-8b",
                   help=f"built-in ({', '.join(MODELS)}), a checkpoint directory or config.json (default %(default)s)")
    g.add_argument("--gpu", choices=sorted(GPUS), help="a hardware profile (roofline cost model)")
    g.add_argument("--calibration", help="a pdctl calibrate file (measured cost model) instead of --gpu")
    g.add_argument("--efficiency", type=float, help="fraction of peak FLOP/s and bandwidth reached (profile default "
                   "0.5 compute / 0.7 bandwidth)")
    g.add_argument("--link", help=f"KV link: {', '.join(LINKS)}, a bandwidth in GB/s, or ucx:FILE / tcp:FILE "
                   "(a benchmarks/kv_transfer.py result); default: the GPU's own (NVLink), else 2 GB/s")


def add_traffic_args(p, rate_default: float | None = 10.0) -> None:
    g = p.add_argument_group("traffic (synthetic, or --trace)")
    g.add_argument("--rate", type=float, default=rate_default, help="requests/s (default %(default)s)")
    g.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals (default %(default)s)")
    g.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    g.add_argument("--cv", type=float, default=2.0, help="gamma arrivals: coefficient of variation (>1 bursty)")
    g.add_argument("--prompt-len", default="loguniform:128:2048",
                   help="fixed:N, uniform:LO:HI, loguniform:LO:HI, normal:MEAN:STD, lognormal:MEDIAN:SIGMA")
    g.add_argument("--output-len", default="loguniform:32:512")
    g.add_argument("--prefix-groups", type=int, default=0, help="shared system prompts (0: none)")
    g.add_argument("--prefix-len", type=int, default=0, help="tokens of each shared system prompt")
    g.add_argument("--trace", help="Mooncake / aiperf JSONL trace (timestamp ms, input_length, output_length, hash_ids)")
    g.add_argument("--trace-block-size", type=int, default=512, help="tokens per trace hash id (default %(default)s)")
    g.add_argument("--trace-time-scale", type=float, default=1.0, help="stretch trace time (2 = half the rate)")
    g.add_argument("--seed", type=int, default=0)


def add_engine_args(p) -> None:
    g = p.add_argument_group("engine (as the workers' flags)")
    g.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=EngineConfig.kv_cache_dtype,
                   help="the workers' (with --gpu: the bytes a token's KV takes in memory, on the link and read a "
                        "decode step; a calibration measured its workers' own)")
    g.add_argument("--num-blocks", type=int, help="KV blocks per worker (default: what fits next to the weights)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the workers' (on a GPU "
                   f"profile {scheduling_defaults('cuda').max_num_batched_tokens}), else the calibration's")
    g.add_argument("--prefill-max-num-batched-tokens", type=int, help="prefill workers' own budget")
    g.add_argument("--max-num-seqs", type=int, default=None, help="default: the workers' (on a GPU profile "
                   f"{scheduling_defaults('cuda').max_num_seqs}), else the calibration's")
    g.add_argument("--max-model-len", type=int, help="default: the model's")
    g.add_argument("--watermark", type=float, default=SchedulerConfig.watermark)
    g.add_argument("--sched", action="append", default=[], metavar="KEY=VALUE",
                   help="any other SchedulerConfig field, e.g. remote_kv_budget=0.3 (repeatable)")
    g.add_argument("--routing-policy", choices=POLICIES, default=RoutingConfig.policy)
    g.add_argument("--skip-prefill-below", type=int, default=RoutingConfig.skip_prefill_below_tokens)
    g.add_argument("--overhead-ms", type=float, default=None, help="gateway + HTTP hops per request (default: the "
                   "calibration's serving fit, else 0)")


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure engine steps on this machine and fit the planner's cost model",
                       description="Run the real engine on a grid of batch shapes (prefill chunks, decode batches, "
                       "mixed) and fit step time = c0 + c1*tokens + c2*seqs + c3*samples + c4*attention pairs + "
                       "c5*context tokens.  The file is what `pdctl plan --calibration FILE` reads.  With --live, fit the "
                       "same model to the steps a running deployment's workers logged instead (their real traffic, "
                       "on their own hardware).",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="default", help="checkpoint directory, .gguf file, or 'default'")
    p.add_argument("--threads", type=int, default=1, help="torch threads: what one worker gets")
    p.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    p.add_argument("--max-num-batched-tokens", type=int, default=scheduling_defaults("cpu").max_num_batched_tokens)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=EngineConfig.kv_cache_dtype,
                   help="the workers' --kv-cache-dtype")
    p.add_argument("--quick", action="store_true", help="a smaller grid (about a minute on a tiny model)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the engine compiled, as workers run it by default (worker --compile)")
    p.add_argument("--out", type=Path, default=Path("calibration.json"))
    live = p.add_argument_group("live", "fit the steps a running deployment's workers ran instead of measuring "
                                "here (through the gateway's admin API: --url, --admin-token)")
    live.add_argument("--live", action="store_true", help="read the workers' step logs and fit those")
    live.add_argument("--window", type=float, default=600.0, help="seconds of steps to read, back from now")
    live.add_argument("--worker", action="append", default=[], metavar="ID",
                      help="only this worker (repeat for more; default: every active worker)")
    live.add_argument("--min-steps", type=int, default=50, help="refuse to fit fewer steps than this")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(client, args) -> int:
    from pdctl.planner.calibrate import calibrate, save

    if args.live:
        doc = calibrate_live(client, args)
    else:
        doc = calibrate(args.model, threads=args.threads, block_size=args.block_size,
                        max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype, quick=args.quick,
                        compile=args.compile, kv_cache_dtype=args.kv_cache_dtype,
                        log=lambda m: print(m, file=sys.stderr))
    save(doc, args.out)
    for warning in doc.get("warnings", ()):
        print(f"pdctl: warning: {warning}", file=sys.stderr)
    print(load_cost_model(args.out).describe(), file=sys.stderr)
    print(json.dumps({"calibration": str(args.out), **doc["cost_model"]}))
    return 0


def calibrate_live(client, args) -> dict:
    """``pdctl calibrate --live``: the calibration fitted to the step logs of the deployment's
    active workers (or ``--worker``s) over the last ``--window`` seconds."""
    from pdctl.admin_client import AdminError
    from pdctl.planner.live import StepLogError, fetch_steps, fit_live

    if not args.window > 0 or args.min_steps < 6:
        raise ValueError("--window must be > 0 and --min-steps at least 6")
    workers = [w for w in client.workers() if w.get("state") == "active" or w.get("worker_id") in args.worker]
    if args.worker:
        missing = set(args.worker) - {w.get("worker_id") for w in workers}
        if missing:
            raise ValueError(f"no such worker(s) in the registry: {', '.join(sorted(missing))}")
        workers = [w for w in workers if w.get("worker_id") in args.worker]
    since = time.time() - args.window
    steps, engines = {}, {}
    for worker in workers:
        worker_id = worker["worker_id"]
        try:
            steps[worker_id], engines[worker_id] = fetch_steps(lambda after: client.steps(worker_id, after), since)
        except (AdminError, StepLogError) as exc:
            print(f"pdctl: skipping {worker_id}: {exc}", file=sys.stderr)
            continue
        print(f"{worker_id} ({worker.get('role')}): {len(steps[worker_id])} steps", file=sys.stderr)
    if not steps:
        raise ValueError("no worker answered with its steps")
    return fit_live(steps, engines, args.min_steps)


def _workers(text: str) -> tuple[int, int]:
    count, _, tp = text.partition("x")
    return int(count), int(tp or 1)


def _parse_split(text: str) -> Deployment:
    try:
        left, right = text.split(":")
        if left == "colocated":
            both, both_tp = _workers(right)
            return Deployment(both=both, both_tp=both_tp)
        (prefill, prefill_tp), (decode, decode_tp) = _workers(left), _workers(right)
        return Deployment(prefill=prefill, decode=decode, prefill_tp=prefill_tp, decode_tp=decode_tp)
    except ValueError:
        raise ValueError(f"--split {text!r}: expected P:D (e.g. 2:6), colocated:N, each count optionally xTP "
                         f"(1x4:2x2)") from None


def _parse_tp_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(s) for s in text.split(",") if s.strip()}))
    except ValueError:
        sizes = ()
    if not sizes or sizes[0] < 1:
        raise ValueError(f"--tp-sizes {text!r}: expected GPU counts per worker, e.g. 1,2,4")
    return sizes


def _scheduler_options(items: list[str]) -> tuple:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--sched {item!r}: expected KEY=VALUE")
        try:
            out.append((key, json.loads(value)))
        except ValueError:
            out.append((key, value))
    return tuple(out)


def _blocks_of_smallest_fitting_worker(args, spec) -> int:
    """KV blocks of a worker of the fewest GPUs that holds the model (what the plan prints as the
    workers' pool; each simulated worker gets what its own GPUs hold)."""
    problem = None
    named = {_parse_split(s).tp_of(role) for s in getattr(args, "split", []) for role in ("prefill", "decode", "both")}
    for tp in sorted(set(_parse_tp_sizes(getattr(args, "tp_sizes", "1"))) | named):
        try:
            return kv_blocks_per_gpu(GPUS[args.gpu], spec, args.block_size, tp=tp)
        except ValueError as exc:
            problem = exc
    raise ValueError(f"{problem} (--tp-sizes, --split AxTP:BxTP)")


def build_config(args) -> tuple[SimConfig, str]:
    """The SimConfig the flags describe, and a one-line description of the cost model."""
    if bool(args.gpu) == bool(args.calibration):
        raise ValueError("give exactly one of --gpu (hardware profile) or --calibration (pdctl calibrate file)")
    calibration_engine: dict = {}
    host = HostEffects()
    if args.gpu:
        spec = load_model_spec(args.model).with_kv_cache_dtype(args.kv_cache_dtype)
        cost = roofline(args.gpu, spec, args.efficiency)
        num_blocks = args.num_blocks or _blocks_of_smallest_fitting_worker(args, spec)
        kv_per_token = spec.kv_bytes_per_token
        max_model_len = args.max_model_len or spec.max_model_len
        batched, seqs = batch_limits(args.max_num_batched_tokens or None, args.max_num_seqs or None,
                                     scheduling_defaults("cuda"), "the default on CUDA")
        link = parse_link(args.link or GPUS[args.gpu].default_link)
    else:
        cost = load_cost_model(args.calibration)
        document = json.loads(Path(args.calibration).read_text())
        calibration_engine = document.get("engine") or {}
        serving = document.get("serving") or {}
        if serving:  # fitted on the real stack (benchmarks/planner_validation.py: fit_stack_overheads)
            from pdctl.planner.calibrate import host_effects, serving_cost

            cost = serving_cost(cost, serving)
            host = host_effects(serving)
        if args.overhead_ms is None and serving.get("request_overhead_s") is not None:
            args.overhead_ms = float(serving["request_overhead_s"]) * 1e3
        if not args.num_blocks:
            raise ValueError("--num-blocks is needed with --calibration (the workers' --num-blocks)")
        if args.kv_cache_dtype != "auto":
            raise ValueError("--kv-cache-dtype goes with --gpu: a calibration measured its workers' own KV cache "
                             "(calibrate workers started with it)")
        num_blocks = args.num_blocks
        kv_per_token = float(calibration_engine.get("kv_bytes_per_token", 0)) or load_model_spec(
            args.model).kv_bytes_per_token
        max_model_len = args.max_model_len or int(calibration_engine.get("max_model_len", 4096))
        cpu = scheduling_defaults("cpu")  # a calibration is measured on CPU workers
        measured = SchedulingDefaults(int(calibration_engine.get("max_num_batched_tokens", cpu.max_num_batched_tokens)),
                                      int(calibration_engine.get("max_num_seqs", cpu.max_num_seqs)))
        batched, seqs = batch_limits(args.max_num_batched_tokens or None, args.max_num_seqs or None, measured,
                                     "the calibrated workers'")
        link = parse_link(args.link or "2")
    engine = EngineSettings(num_blocks=num_blocks, block_size=args.block_size, max_num_batched_tokens=batched,
                            max_num_seqs=seqs, max_model_len=max_model_len, watermark=args.watermark,
                            scheduler_options=_scheduler_options(args.sched))
    engine.scheduler_config()  # fail now, naming the field, on a bad setting
    prefill_engine = None
    if args.prefill_max_num_batched_tokens:
        prefill_engine = dataclasses.replace(engine, max_num_batched_tokens=args.prefill_max_num_batched_tokens)
    config = SimConfig(cost=cost, engine=engine, prefill_engine=prefill_engine, link=link,
                       blocks_from_memory=bool(args.gpu and not args.num_blocks),
                       kv_bytes_per_token=kv_per_token,
                       routing=RoutingConfig(policy=args.routing_policy, skip_prefill_below_tokens=args.skip_prefill_below),
                       slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot, overhead_s=(args.overhead_ms or 0.0) / 1e3,
                       host=host, seed=args.seed)
    return config, cost.describe()


def build_workload(args, max_model_len: int):
    if args.trace:
        return load_trace(args.trace, args.trace_block_size, time_scale=args.trace_time_scale)
    return synthetic(args.rate, args.duration, LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len),
                     args.arrival, args.cv, args.prefix_groups, args.prefix_len, args.seed, max_model_len)


def cmd_plan(_client, args) -> int:
    if args.slo_ttft <= 0 or args.slo_tpot <= 0:
        raise ValueError("SLOs must be > 0 seconds")
    config, cost_text = build_config(args)
    workload = build_workload(args, config.engine.max_model_len)
    if not len(workload):
        raise ValueError("the traffic has no requests (raise --rate or --duration)")
    say = (lambda *a: None) if args.quiet else (lambda m: print(m, flush=True))
    say(f"cost model: {cost_text}")
    say(f"KV link: {config.link.name} ({config.link.bandwidth / 1e9:.3g} GB/s); "
        f"{config.engine.num_blocks} KV blocks x {config.engine.block_size} tokens per worker")
    say(f"traffic: {workload.description} ({len(workload)} requests)")
    config = dataclasses.replace(config, stop_when_failing=True)
    # The simulator (on the engine's scheduler, with torch) loads only for the commands that simulate.
    from pdctl.planner.search import fits, fluid_estimate, rank_key, recommend, search, simulate

    if args.split:
        deployments = [_parse_split(s) for s in args.split]
        for d in deployments:
            problem = fits(d, config)
            if problem:
                raise ValueError(f"--split {d.label}: {problem}")
        results = [simulate(d, workload, config, args.budget) for d in deployments]
        plan = {"fluid": fluid_estimate(workload, config), "candidates": sorted(results, key=rank_key),
                "recommended": recommend(results)}
    else:
        colocated = not args.no_colocated
        plan = search(workload, config, gpus=args.gpus, max_gpus=args.max_gpus, budget=args.budget,
                      colocated=colocated, log=say, tp_sizes=_parse_tp_sizes(args.tp_sizes))
        for label, problem in plan["skipped"].items():
            say(f"  {label:>10}: skipped, {problem}")
    plan["slo"] = {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot, "percentile": 90}
    plan["traffic"] = workload.summary()
    plan["cost_model"] = cost_text
    best = plan["recommended"]
    say("")
    from pdctl.planner.report import table

    say(table(plan["candidates"]))
    f = plan["fluid"]
    say(f"fluid bound: {f['prefill_gpus']:.2f} prefill + {f['decode_gpus']:.2f} decode GPUs "
        f"({f['prefill_tok_s_per_gpu']:.0f} prompt tok/s and {f['decode_tok_s_per_gpu']:.0f} output tok/s per GPU)")
    if best:
        say(f"recommended: {best['deployment']} ({best['gpus']} GPUs): TTFT p90 {best['ttft_ms']['p90']:.0f} ms, "
            f"TPOT p90 {best['tpot_ms']['p90']:.1f} ms, goodput {best['goodput_req_s']:.3g} req/s")
    else:
        say("no simulated deployment meets the SLOs: raise --max-gpus, relax the SLOs or lower the rate")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(clean(plan), indent=2))
        try:
            from pdctl.planner.report import plot

            png = plot(plan, args.out.with_suffix(".png"), f"{workload.description} | SLO p90 TTFT "
                       f"{args.slo_ttft:g}s TPOT {args.slo_tpot * 1e3:g}ms")
            say(f"wrote {args.out} and {png}")
        except ImportError:
            print("pdctl plan: matplotlib is not installed, so no PNG (pip install matplotlib)", file=sys.stderr)
    print(json.dumps(clean(final_line(plan))))
    return 0


def final_line(plan: dict) -> dict:
    best = plan["recommended"]
    keys = ("deployment", "gpus", "prefill", "decode", "both", "prefill_tp", "decode_tp", "both_tp", "ttft_ms",
            "tpot_ms", "itl_ms", "goodput_req_s",
            "meets_slo", "slo_ratio", "preemptions", "transfer_gb_s")
    return {"recommended": None if best is None else {k: best[k] for k in keys},
            "candidates": [{k: r[k] for k in keys} | {"kv_usage_decode_peak": (r.get("decode_pool") or {}).get(
                "kv_usage_peak")} for r in plan["candidates"]],
            "slo": plan["slo"], "fluid": plan["fluid"]}


def clean(value):
    """JSON-safe: an infinite latency (a request that never finished) is written as "inf"."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


# ---- pdctl rebalance --gpu / --calibration ---------------------------------------------------


def add_rebalance_model_args(p) -> None:
    """The flags ``pdctl rebalance`` takes to choose its split by simulation (see planner/rebalance.py)."""
    add_model_args(p)
    add_traffic_args(p, rate_default=None)
    add_engine_args(p)
    g = p.add_argument_group("simulation (with --gpu or --calibration the split is chosen by simulating the traffic "
                             "on every split of the movable workers)")
    g.add_argument("--budget", type=float, default=DEFAULT_BUDGET / 4,
                   help="request-steps simulated per split before sampling")


def rebalance_by_simulation(readings, args):
    """A ``pdctl.rebalance.Plan`` chosen by simulating every split of the movable workers."""
    from pdctl.planner.rebalance_sim import estimated_rate, simulated_plan

    args.slo_ttft, args.slo_tpot = args.ttft_target, args.tpot_target
    config, _ = build_config(args)
    note = None
    if args.rate is None and not args.trace:
        mean_prompt = LengthDist.parse(args.prompt_len).mean + (args.prefix_len if args.prefix_groups else 0)
        args.rate = estimated_rate(readings, mean_prompt)
        if args.rate is None:
            raise ValueError("the prefill pool reports no prompt tokens/s to estimate the rate from: pass --rate")
        note = (f"rate estimated from the readings: {args.rate:.3g} req/s (prefill pool tokens/s / mean prompt "
                f"{mean_prompt:.0f})")
    workload = build_workload(args, config.engine.max_model_len)
    result = simulated_plan(readings, workload, dataclasses.replace(config, stop_when_failing=True), args.budget)
    if note:
        result.reasons.insert(0, note)
    return result
