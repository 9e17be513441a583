"""The planner validation's probes and predictions: the probe runs that fit the serving cost model
(short and long prompts, a batch of streams, cold starts, a prompt contending with streams), their
simulated twins, and the simulation of a measured run's split (``predict``)."""
from __future__ import annotations

import asyncio

import numpy as np

from benchmarks.loadgen import PlannedRequest, random_ids, run_load

# The two ways the validation runs one machine's two workers.
SPLITS = {"1P+1D": dict(prefill=1, decode=1, both=0), "2C": dict(prefill=0, decode=0, both=2)}

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
    from pdctl.planner.traffic import Workload

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
    from pdctl.planner.calibrate import (
        cold_slowdowns, fit_host_effects, fit_stack_overheads, serving_cost,
    )
    from pdctl.planner.sim_config import HostEffects

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
    from common.engine.kv.prefix_hash import block_extra_keys, hash_prompt_blocks

    extra = block_extra_keys(model_id)
    return [hash_prompt_blocks(r.prompt[:block_size], block_size, extra)[0] if len(r.prompt) >= block_size else b""
            for r in plan]


def simulation(split: str, workload, cost, args, overhead_s: float, host, speed=None, affinity=None):
    """Runs the simulator on ``workload`` as the stack was set up (``speed``: a ``SpeedTrace`` to
    replay; ``affinity``: ``affinity_keys`` of the real requests); returns its result and itself."""
    from pdctl.planner.hardware import LinkProfile
    from pdctl.planner.sim_config import Deployment, EngineSettings, SimConfig
    from pdctl.planner.simulator import Simulation

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
