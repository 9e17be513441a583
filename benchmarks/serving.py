"""Serving benchmark: open-loop Poisson load against whole stacks (gateway + workers + Redis).

By default each scenario starts the stacks it compares (real processes through
``launcher.local_stack.LocalStack``, CPU, one after the other, same seed and workload), runs the same
workload against each, stops them, and compares.  With ``--url`` it runs the scenario's workload
once against a gateway that is already up and reports that one configuration (ratios are null).

    python benchmarks/serving.py --scenario prefix [--quick]
    python benchmarks/serving.py --scenario interference [--quick]
    python benchmarks/serving.py --scenario prefix --url http://127.0.0.1:8000 --model default

Scenarios
---------
``prefix`` -- several long shared prefixes (system prompts) + short unique suffixes, the prefix of
    each request drawn uniformly.  2 prefill workers + 1 decode worker, ``--skip-prefill-below 0``
    (every prompt goes through the prefill pool, so the decode worker's own cache cannot hide the
    routing).  Each prefill worker's KV pool is ``--pool-fraction`` (default 0.6) of all the
    prefixes' blocks: all prefixes together overflow one worker but fit in two, with 20% to spare
    for the requests in flight.  ``prefix_aware`` routing partitions the prefixes over the two workers
    and keeps hitting; ``round_robin`` sends every prefix to both and each LRU pool thrashes.  The
    decode worker gets a pool four times the size of all prefixes, so it never refuses a reservation
    (that would fall back to local prefill and blur the comparison).  Before measuring, each
    prefix is sent once (sequentially, identically for both stacks): the steady state of a service
    whose system prompts are known, not its cold start.  Result:
    ``ttft_p50_ratio_round_robin_over_prefix_aware`` (target >= 2), with prefill-pool hit rates
    from the workers' /stats (counter deltas over the measured window).

``interference`` -- steady decode streams (short prompts, long outputs, Poisson arrivals) plus long
    prompts (1-2k tokens, 4 output tokens) arriving as a second Poisson stream, on equal resources:
    ``--cores N`` (default 2, even) cores for each stack, every worker pinned to one core of its own
    (CPU affinity set before exec, ``OMP_NUM_THREADS=1``).  disaggregated = N/2 prefill + N/2 decode
    workers, gateway ``--skip-prefill-below`` between the two prompt lengths so the streams go
    straight to a decode worker and the long prompts through the prefill pool.  colocated = N
    ``both`` workers, each computing the prompts of the requests it decodes (no prompt is shipped
    between two ``both`` workers), chunked Sarathi-style under the same
    ``--max-num-batched-tokens`` (default 512).  TPOT/ITL are measured on the steady streams only;
    the long prompts' TTFT is reported too (disaggregation must not win by starving them), and so
    are remote-prefill fallbacks.  Goodput, as DistServe defines it: requests/s meeting both
    ``--slo-ttft`` and ``--slo-tpot``.  Result: ``itl_p99_ratio_coloc_over_disagg`` (target >= 2),
    ``goodput_ratio_disagg_over_coloc`` (target >= 1), the TPOT p99 ratio, and ``winner``.  With two
    colocated workers the long prompts stall only half the streams, and the colocated stack has
    twice the decode capacity: the comparison the operator faces with N GPUs.

``concurrency`` -- what NVIDIA aiperf's ``--concurrency`` does: ``--concurrency`` (default 8)
    closed-loop clients send ``--num-requests`` (48) requests of ``--prompt-len`` (256) tokens and
    ``--output-len`` (64), each client its next request as soon as its last one ended, against one
    colocated worker and against 1 prefill + 1 decode worker, as ``make up`` runs them (no pinning,
    the default prefill threshold).  Default model: ``default`` (Gemma 3 270M).  Reports output
    tok/s, ITL, TTFT and TPOT, plus the engine's own time accounting from the workers' /stats:
    seconds inside engine steps and seconds between two steps while work was waiting
    (``engine_gap_s``: the engine-thread/event-loop handoff's cost).

Load generator (``benchmarks/loadgen.py``): asyncio + aiohttp, SSE parsed by hand, open loop --
request i is sent at its Poisson arrival time whatever happened to earlier ones (closed loop for
``concurrency``).  Prompts are
token-id lists (exact lengths) from ids 3..vocab-1; ``ignore_eos`` makes output lengths exact.
TTFT = first text chunk - send; ITL = gaps between text chunks; TPOT = (e2e - TTFT)/(tokens - 1)
with tokens from the usage chunk; goodput = completed requests/s meeting both ``--slo-ttft`` and
``--slo-tpot`` (single-token answers need only the TTFT SLO).  All seeds fixed (``--seed``).

Model: default ``--model 100m``, a random-weight ~110M-parameter Llama (``write_random_llama``),
where a 1k-token prefill costs tens of decode steps on this CPU; ``tiny`` with ``--quick``;
``default`` (Gemma 3 270M) or a checkpoint path also work.  Random checkpoints get a word-level
tokenizer covering the whole vocabulary (token i <-> word ``t<i>``), so every generated token
streams as a non-empty text chunk and ITL is measured per token.

Outputs: ``--out`` (default ``benchmarks/results/serving-<scenario>[-quick].json``) with every
configuration's TTFT/TPOT/ITL/e2e p50/p90/p99 (ms), output tok/s, goodput, errors and worker stats,
and a PNG of the TTFT/TPOT/ITL CDFs next to it.  The last stdout line is one JSON object.

Run time on 2 shared CPU cores: ``--quick`` (tiny model) about 1-2 minutes per scenario; the full
versions (100m model) about 6-8 minutes per scenario.  Stacks are always stopped (also on
Ctrl-C / SIGTERM); each stack uses its own Redis key prefix.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_util import emit, write_random_llama  # noqa: E402
from benchmarks.loadgen import (  # noqa: E402
    LengthDist, PlannedRequest, poisson_times, random_ids, run_closed_loop, run_load,
)
from benchmarks.serving_report import final_line, plot, report  # noqa: E402
from launcher.local_stack import LocalStack, http_json  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

# Presets: full (100m model) and --quick (tiny model).  Every value can be overridden by its flag.
PRESETS = {
    "prefix": {
        "full": dict(model="100m", num_prefixes=8, prefix_len=1024, suffix_len="uniform:16:64", output_len="fixed:16",
                     rate=0.5, num_requests=80, slo_ttft=3.0, slo_tpot=0.5),
        "quick": dict(model="tiny", num_prefixes=8, prefix_len=1024, suffix_len="uniform:16:64", output_len="fixed:8",
                      rate=2.5, num_requests=80, slo_ttft=1.0, slo_tpot=0.1),
    },
    "interference": {
        "full": dict(model="100m", stream_rate=0.5, stream_prompt_len="uniform:32:64",
                     stream_output_len="uniform:96:128", long_rate=0.1, long_prompt_len="uniform:1024:2048",
                     long_output_len="fixed:4", duration=150.0, slo_ttft=5.0, slo_tpot=0.3),
        "quick": dict(model="tiny", stream_rate=4.0, stream_prompt_len="uniform:32:64",
                      stream_output_len="uniform:64:96", long_rate=0.5, long_prompt_len="uniform:1024:2048",
                      long_output_len="fixed:4", duration=30.0, slo_ttft=1.0, slo_tpot=0.05),
    },
    "concurrency": {
        "full": dict(model="default", num_requests=48, prompt_len="fixed:256", output_len="fixed:64", concurrency=8,
                     slo_ttft=5.0, slo_tpot=0.5),
        "quick": dict(model="tiny", num_requests=24, prompt_len="fixed:256", output_len="fixed:32", concurrency=8,
                      slo_ttft=2.0, slo_tpot=0.2),
    },
}


# ---- model --------------------------------------------------------------------------------------

def write_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer where id i is the word ``t<i>``: every id decodes to non-empty text."""
    if (directory / "tokenizer.json").exists():
        return
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(directory)


def prepare_model(model: str) -> tuple[str, int]:
    """The checkpoint directory to serve and its vocabulary size."""
    from common.engine.loading.checkpoint_path import resolve_checkpoint

    if model in ("100m", "tiny"):
        directory = write_random_llama(Path(tempfile.gettempdir()) / f"pdserve-serving-llama-{model}", model)
        from transformers import AutoConfig

        write_word_tokenizer(directory, AutoConfig.from_pretrained(directory).vocab_size)
        checkpoint = directory
    else:
        checkpoint = resolve_checkpoint(model)
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    return str(checkpoint), config.get("vocab_size") or config["text_config"]["vocab_size"]


# ---- workloads ----------------------------------------------------------------------------------

def prefix_workload(args, vocab: int) -> tuple[list[PlannedRequest], list[PlannedRequest]]:
    """(warm-up, measured): shared prefixes + unique suffixes, prefix drawn uniformly per request."""
    rng = random.Random(args.seed)
    prefixes = [random_ids(rng, args.prefix_len, vocab) for _ in range(args.num_prefixes)]
    suffix, output = LengthDist.parse(args.suffix_len), LengthDist.parse(args.output_len)
    warmup = [PlannedRequest(p + random_ids(rng, suffix.sample(rng), vocab), output.sample(rng), 0.0, "warmup")
              for p in prefixes]
    times = poisson_times(rng, args.rate, args.num_requests)
    plan = []
    for t in times:
        p = rng.randrange(args.num_prefixes)
        plan.append(PlannedRequest(prefixes[p] + random_ids(rng, suffix.sample(rng), vocab),
                                   output.sample(rng), t, "prefix"))
    return warmup, plan


def interference_workload(args, vocab: int) -> tuple[list[PlannedRequest], list[PlannedRequest]]:
    """(warm-up, measured): Poisson steady streams + Poisson long prompts over ``duration`` seconds."""
    rng = random.Random(args.seed)
    dists = {k: LengthDist.parse(getattr(args, k)) for k in
             ("stream_prompt_len", "stream_output_len", "long_prompt_len", "long_output_len")}
    plan = []
    for kind, rate in (("stream", args.stream_rate), ("long", args.long_rate)):
        t = rng.expovariate(rate)
        while t < args.duration:
            prompt = random_ids(rng, dists[f"{kind}_prompt_len"].sample(rng), vocab)
            plan.append(PlannedRequest(prompt, dists[f"{kind}_output_len"].sample(rng), t, kind))
            t += rng.expovariate(rate)
    plan.sort(key=lambda r: r.send_at)
    warmup = [PlannedRequest(random_ids(rng, 48, vocab), 8, 0.0, "warmup"),
              PlannedRequest(random_ids(rng, dists["long_prompt_len"].low, vocab), 4, 0.0, "warmup")]
    return warmup, plan


# ---- stacks -------------------------------------------------------------------------------------

class BenchStack(LocalStack):
    """A LocalStack whose workers get extra flags by role (prefill and decode pools sized apart)."""

    role_args: dict[str, list[str]]

    def start_worker(self, name: str, role: str):
        saved = self.worker_args
        self.worker_args = [*saved, *getattr(self, "role_args", {}).get(role, [])]
        try:
            return super().start_worker(name, role)
        finally:
            self.worker_args = saved


def stack_configs(args) -> dict[str, dict]:
    """Name -> how to build that configuration's stack."""
    common = ["--block-size", str(args.block_size), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.scenario == "prefix":
        prefix_blocks = args.num_prefixes * math.ceil(args.prefix_len / args.block_size)
        # 2 x 0.6 = 1.2: all prefixes fit in the two pools together, with 20% to spare for requests in
        # flight, but not in one.  The decode worker must never refuse a reservation.
        prefill_blocks = math.ceil(args.pool_fraction * prefix_blocks)
        decode_blocks = 4 * prefix_blocks
        role_args = {"prefill": ["--num-blocks", str(prefill_blocks)], "decode": ["--num-blocks", str(decode_blocks)]}
        base = dict(prefill=2, decode=1, role_args=role_args, extra_env={"OMP_NUM_THREADS": "1"},
                    gateway_args=["--skip-prefill-below", "0"], worker_args=common)
        return {"prefix_aware": dict(base, policy="prefix_aware"), "round_robin": dict(base, policy="round_robin")}
    if args.scenario == "concurrency":
        # As `make up` runs them: no thread pinning, the gateway's default prefill threshold (a
        # 256-token prompt goes through the prefill pool).
        return {"colocated": dict(prefill=0, decode=0, both=1, policy="prefix_aware", worker_args=common),
                "disaggregated": dict(prefill=1, decode=1, policy="prefix_aware", worker_args=common)}
    blocks = ["--num-blocks", str(args.num_blocks)]
    if args.cores < 2 or args.cores % 2:
        raise SystemExit(f"--cores must be even and >= 2, got {args.cores}")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < args.cores:
        raise SystemExit(f"--cores {args.cores}: this process may run on {len(cores)} CPUs only")
    half = args.cores // 2
    # Equal resources: every worker one core (OMP_NUM_THREADS=1, pinned), N of them in both stacks.
    disagg_names = [f"p{i}" for i in range(half)] + [f"d{i}" for i in range(half)]
    coloc_names = [f"b{i}" for i in range(args.cores)]
    one_thread = {"OMP_NUM_THREADS": "1"}
    return {
        "disaggregated": dict(prefill=half, decode=half, policy="prefix_aware", worker_args=common + blocks,
                              gateway_args=["--skip-prefill-below", str(args.skip_prefill_below)],
                              extra_env=one_thread, cpus={n: [c] for n, c in zip(disagg_names, cores)}),
        # Every prompt is computed by the worker that decodes it (never shipped between two `both`s).
        "colocated": dict(prefill=0, decode=0, both=args.cores, policy="prefix_aware", worker_args=common + blocks,
                          gateway_args=["--skip-prefill-below", str(1 << 30)],
                          extra_env=one_thread, cpus={n: [c] for n, c in zip(coloc_names, cores)}),
    }


def concurrency_workload(args, vocab: int) -> tuple[list[PlannedRequest], list[PlannedRequest]]:
    """(warm-up, measured): ``num_requests`` fixed-shape requests, sent closed-loop."""
    rng = random.Random(args.seed)
    prompt, output = LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len)
    plan = [PlannedRequest(random_ids(rng, prompt.sample(rng), vocab), output.sample(rng), 0.0, "request")
            for _ in range(args.num_requests)]
    warmup = [PlannedRequest(random_ids(rng, prompt.low, vocab), 8, 0.0, "warmup") for _ in range(2)]
    return warmup, plan


STAT_KEYS = ("prompt_tokens_total", "prefix_cache_hit_tokens_total", "prefill_computed_tokens",
             "prefill_cached_tokens", "num_preemptions", "remote_prefill_fallbacks", "kv_transfer_failures",
             "kv_sent_bytes", "kv_received_bytes", "engine_steps", "engine_step_seconds", "engine_gap_seconds")


GATEWAY_COUNTERS = ("pdserve_redis_unavailable_total", "pdserve_prefill_skipped_total")


def snapshot(stack: LocalStack) -> dict[str, dict]:
    return {name: stack.stats(name) for name in stack.procs if name != "gateway"}


def gateway_counters(url: str) -> dict[str, float]:
    """A few gateway counters (summed over labels) from its Prometheus text."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(GATEWAY_COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def stat_deltas(before: dict, after: dict) -> dict[str, dict]:
    out = {}
    for name, a in after.items():
        d = {k: a[k] - before[name].get(k, 0) for k in STAT_KEYS if k in a}
        d.update(role=a.get("role"), num_blocks=a.get("num_blocks"))
        pc, pk = d.get("prefill_cached_tokens", 0), d.get("prefill_computed_tokens", 0)
        d["prefill_hit_rate"] = round(pc / (pc + pk), 3) if pc + pk else None
        hits, total = d.get("prefix_cache_hit_tokens_total", 0), d.get("prompt_tokens_total", 0)
        d["engine_hit_rate"] = round(hits / total, 3) if total else None
        out[name] = d
    return out


async def warm_up(url: str, model: str, warmup: list[PlannedRequest]) -> None:
    """Send the warm-up requests one at a time; any error here is fatal (the stack is broken)."""
    for req in warmup:
        records, _ = await run_load(url, model, [req])
        if not records[0].ok:
            raise RuntimeError(f"warm-up request failed: {records[0].error}")
    await asyncio.sleep(1.0)  # let the prefix index catch up with what the warm-up cached


def measure(url: str, model: str, warmup, plan, args, stack: LocalStack | None) -> dict:
    asyncio.run(warm_up(url, model, warmup))
    before = snapshot(stack) if stack else None
    gw_before = gateway_counters(url)
    if args.scenario == "concurrency":
        load = run_closed_loop(url, model, plan, args.concurrency, args.request_timeout, args.temperature)
    else:
        load = run_load(url, model, plan, timeout=args.request_timeout)
    records, wall = asyncio.run(load)
    result = {"wall_s": round(wall, 1), "records": records,
              "gateway": {k: v - gw_before[k] for k, v in gateway_counters(url).items()}}
    if stack:
        result["workers"] = stat_deltas(before, snapshot(stack))
    return result


def run_stack(name: str, config: dict, checkpoint: str, warmup, plan, args) -> dict:
    kwargs = dict(config)
    role_args = kwargs.pop("role_args", {})
    workdir = Path(tempfile.mkdtemp(prefix=f"pdserve-serving-{name}-"))
    stack = BenchStack(checkpoint, args.redis_url, key_prefix=f"bench-serving-{uuid.uuid4().hex[:10]}",
                       workdir=workdir, transport=args.transport, **kwargs)
    stack.role_args = role_args
    print(f"[{name}] starting stack (logs in {workdir})", file=sys.stderr, flush=True)
    try:
        stack.start(timeout=600)
        model = http_json(f"{stack.gateway_url}/v1/models")["data"][0]["id"]
        print(f"[{name}] running {len(plan)} requests", file=sys.stderr, flush=True)
        result = measure(stack.gateway_url, model, warmup, plan, args, stack)
    finally:
        stack.stop()
    result.update(stack={k: v for k, v in config.items()}, logs=str(workdir))
    return result


# ---- reporting ----------------------------------------------------------------------------------

# ---- main ---------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=tuple(PRESETS), required=True)
    p.add_argument("--quick", action="store_true", help="tiny model, smaller workload: a couple of minutes")
    p.add_argument("--url", help="gateway of a running stack: run the workload once against it")
    p.add_argument("--model", help="100m | tiny (random Llama) | default (Gemma 3 270M) | checkpoint path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="JSON path (PNG next to it)")
    p.add_argument("--slo-ttft", type=float, help="seconds")
    p.add_argument("--slo-tpot", type=float, help="seconds")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379")
    p.add_argument("--transport", default="tcp", choices=("tcp", "ucx"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--request-timeout", type=float, default=900)
    g = p.add_argument_group("concurrency scenario (also --num-requests, --output-len)")
    g.add_argument("--prompt-len", help="length distribution")
    g.add_argument("--concurrency", type=int, help="closed-loop clients")
    g.add_argument("--temperature", type=float, default=0.0)
    g = p.add_argument_group("prefix scenario")
    g.add_argument("--num-prefixes", type=int)
    g.add_argument("--prefix-len", type=int)
    g.add_argument("--suffix-len", help="length distribution, e.g. uniform:16:64")
    g.add_argument("--output-len", help="length distribution")
    g.add_argument("--rate", type=float, help="requests/s")
    g.add_argument("--num-requests", type=int)
    g.add_argument("--pool-fraction", type=float, default=0.6,
                   help="each prefill worker's KV pool, as a fraction of all prefix blocks (0.5 < f < 1)")
    g = p.add_argument_group("interference scenario")
    g.add_argument("--stream-rate", type=float, help="steady streams started per second")
    g.add_argument("--stream-prompt-len")
    g.add_argument("--stream-output-len")
    g.add_argument("--long-rate", type=float, help="long prompts per second")
    g.add_argument("--long-prompt-len")
    g.add_argument("--long-output-len")
    g.add_argument("--duration", type=float, help="seconds of arrivals")
    g.add_argument("--cores", type=int, default=2,
                   help="total cores of each stack (even): N colocated workers vs N/2 prefill + N/2 decode, "
                        "one pinned core and one thread each")
    g.add_argument("--skip-prefill-below", type=int, default=256,
                   help="disaggregated gateway: prompts below this go straight to the decode worker")
    g.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per worker (interference)")
    args = p.parse_args(argv)
    for key, value in PRESETS[args.scenario]["quick" if args.quick else "full"].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/serving.py needs matplotlib for its plot: "
                 ".venv/bin/pip install matplotlib   (or: pip install -e '.[test]')")

    def on_term(_sig, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    out = args.out or RESULTS / f"serving-{args.scenario}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    checkpoint, vocab = prepare_model(args.model)
    workload = {"prefix": prefix_workload, "interference": interference_workload,
                "concurrency": concurrency_workload}[args.scenario]
    warmup, plan = workload(args, vocab)

    results: dict[str, dict] = {}
    if args.url:
        model = http_json(f"{args.url}/v1/models")["data"][0]["id"]
        results["url"] = measure(args.url, model, warmup, plan, args, None)
    else:
        for name, config in stack_configs(args).items():
            results[name] = run_stack(name, config, checkpoint, warmup, plan, args)

    summaries = {name: report(res, args) for name, res in results.items()}
    for name, s in summaries.items():
        workers = s.get("workers", {})
        prefill = [w for w in workers.values() if w["role"] == "prefill"]
        cached = sum(w.get("prefill_cached_tokens", 0) for w in prefill)
        computed = sum(w.get("prefill_computed_tokens", 0) for w in prefill)
        s["prefill_hit_rate"] = round(cached / (cached + computed), 3) if cached + computed else None
        print(f"[{name}] {json.dumps(s['all'])}", file=sys.stderr)
    params = {k: v for k, v in vars(args).items() if not isinstance(v, Path)}
    out.write_text(json.dumps({"params": params, "checkpoint": checkpoint, "configurations": summaries,
                               "result": final_line(summaries, args, checkpoint)}, indent=2))
    plot(results, args, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    emit(final_line(summaries, args, checkpoint))


if __name__ == "__main__":
    main()
