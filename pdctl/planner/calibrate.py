"""``pdctl calibrate``: measure engine steps on this machine and fit a ``LinearCostModel``.

The real ``Engine`` (model runner, attention, sampler and scheduler) runs a grid of small
workloads chosen to cover the step shapes a deployment produces::

    prefill    one prompt of L tokens, chunked by max_num_batched_tokens  (tokens, pairs, context)
    decode     b requests of context c decoding together                   (seqs, samples, context)
    mixed      decodes running while a prompt's chunks join them            (both at once)

Every step is timed by the engine's step log (scheduling, forward, sampling and update, as in serving)
and its shape read from the ``SchedulerOutput``.  Repeated shapes keep their median time.
The file it writes holds the fitted coefficients, the fit's relative errors and the engine
settings it was measured with, and is what ``pdctl plan --calibration FILE`` reads.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from pdctl.planner.cost_model import LinearCostModel, ServingCostModel, fit_linear
from common.engine.config import SCHEDULING_DEFAULTS, EngineConfig

QUICK_GRID = {"prefill": (16, 128, 512, 1024), "decode_batch": (1, 4, 16, 32), "decode_context": (32, 512, 1024),
              "mixed": ((8, 256, 512),), "repeats": 2, "decode_steps": 4}
FULL_GRID = {"prefill": (16, 64, 256, 512, 1024, 2048), "decode_batch": (1, 2, 4, 8, 16, 32, 64),
             "decode_context": (32, 256, 1024, 2048), "mixed": ((4, 128, 1024), (16, 512, 2048)),
             "repeats": 3, "decode_steps": 6}


class StepRecorder:
    """Steps ``engine`` and keeps the time and shape of each step its ``step_log`` recorded."""

    def __init__(self, engine):
        self.engine = engine
        self.samples: list[tuple[tuple, float]] = []

    def step(self, record: bool = True) -> None:
        log = self.engine.step_log
        before = log.total
        self.engine.step()
        if record and log.total > before:
            row = log.since()[-1]
            self.samples.append((tuple(row[2:]), float(row[1])))


def _ids(n: int, salt: int, vocab: int) -> list[int]:
    """A prompt that shares no block with any other (so no prefix hit skews a measurement)."""
    return [3 + (salt * 7919 + k * 31) % (vocab - 3) for k in range(n)]


def run_grid(engine, grid: dict, log=None) -> list[tuple[tuple, float]]:
    """Run the calibration workloads on ``engine`` and return ``(shape, seconds)`` per step."""
    from common.engine.sampling_params import SamplingParams

    rec = StepRecorder(engine)
    vocab = engine.model_config.vocab_size
    limit = engine.max_model_len - 8
    salt = [0]

    def add(n: int, max_tokens: int) -> None:
        salt[0] += 1
        engine.add_request(_ids(min(n, limit), salt[0], vocab), SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    def drain(record: bool = True) -> None:
        while engine.has_unfinished():
            rec.step(record)

    add(32, 2)
    drain(record=False)  # warm-up: first calls allocate and compile
    for _ in range(grid["repeats"]):
        for length in grid["prefill"]:
            add(length, 1)
            drain()
        for context in grid["decode_context"]:
            for batch in grid["decode_batch"]:
                for _ in range(batch):
                    add(context, grid["decode_steps"] + 1)
                drain()
        for batch, context, prompt in grid["mixed"]:
            for _ in range(batch):
                add(context, 2 * grid["decode_steps"] + prompt // engine.config.max_num_batched_tokens + 2)
            rec.step()
            add(prompt, 1)
            drain()
        if log:
            log(f"  {len(rec.samples)} steps measured")
    return rec.samples


def median_by_shape(samples: list[tuple[tuple, float]]) -> tuple[list[tuple], list[float]]:
    by_shape: dict[tuple, list[float]] = {}
    for shape, seconds in samples:
        by_shape.setdefault(shape, []).append(seconds)
    shapes = sorted(by_shape)
    return shapes, [statistics.median(by_shape[s]) for s in shapes]


def calibrate(model: str, *, threads: int | None = None, block_size: int = EngineConfig.block_size,
              max_num_batched_tokens: int = SCHEDULING_DEFAULTS["cpu"].max_num_batched_tokens,
              max_num_seqs: int = SCHEDULING_DEFAULTS["cpu"].max_num_seqs, num_blocks: int | None = None, dtype: str = "auto", quick: bool = False,
              compile: bool = True, kv_cache_dtype: str = EngineConfig.kv_cache_dtype, log=None) -> dict:
    """Measure and fit; returns the calibration document (``cost_model``, ``engine``, ``fit``).
    ``compile``: the engine as workers run it by default (``--compile``)."""
    import torch

    from common.engine.engine import Engine
    from common.engine.kv.kv_cache import dtype_name

    if threads:
        torch.set_num_threads(threads)
    grid = QUICK_GRID if quick else FULL_GRID
    batches = max(grid["decode_batch"])
    longest = max(max(grid["prefill"]), max(grid["decode_context"]))
    need_blocks = batches * (longest // block_size + 4) + 64
    config = EngineConfig(model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, device="cpu",
                          block_size=block_size, num_blocks=num_blocks or need_blocks,
                          # (the grid's largest decode batch in one step: its rows, and a token each)
                          max_num_batched_tokens=max(max_num_batched_tokens, batches),
                          max_num_seqs=max(max_num_seqs, batches), enable_prefix_caching=False, compile=compile)
    engine = Engine(config, load_tokenizer=False)
    began = time.perf_counter()
    samples = run_grid(engine, grid, log)
    shapes, seconds = median_by_shape(samples)
    source = {"model": str(engine.checkpoint), "threads": torch.get_num_threads(), "dtype": dtype_name(engine.dtype),
              "kv_cache_dtype": engine.layout.dtype,
              "compiled": engine.model.stages.compiled,
              "max_num_batched_tokens": max_num_batched_tokens, "grid": "quick" if quick else "full",
              "measured_s": round(time.perf_counter() - began, 1)}
    model_fit: LinearCostModel = fit_linear(shapes, seconds, source)
    layout = engine.layout
    return {
        "cost_model": model_fit.to_dict(),
        "engine": {"block_size": block_size, "kv_bytes_per_token": layout.block_nbytes / block_size,
                   "max_num_batched_tokens": max_num_batched_tokens, "max_model_len": engine.max_model_len,
                   "model_id": engine.model_id},
        "points": [{"shape": list(s), "seconds": round(t, 6),
                    "predicted": round(model_fit.step_time(*s), 6)} for s, t in zip(shapes, seconds)],
    }


def prefill_seconds(cost, prompt_len: int, chunk: int) -> tuple[float, int]:
    """Engine time to compute a lone prompt in chunks of ``chunk`` tokens, and the number of steps."""
    total, start, steps = 0.0, 0, 0
    while start < prompt_len:
        q = min(chunk, prompt_len - start)
        last = start + q == prompt_len
        total += cost.step_time(q, 1, int(last), q * (start + (q + 1) / 2), start + q)
        start += q
        steps += 1
    return total, steps


def fit_stack_overheads(cost, *, ttft_short_s: float, ttft_long_s: float, tpot_s: float, short_len: int,
                        long_len: int, chunk: int, decode_context: int, tpot_batch_s: float | None = None,
                        batch: int = 1) -> dict:
    """How a serving stack runs the calibrated engine right now, from requests sent to an idle
    stack (so no queueing or prefill/decode interference is in them):

    - ``speed``: how much slower than calibrated prefill steps run now -- from the difference of
      a long and a short prompt's TTFT, where every fixed cost cancels;
    - ``decode_speed`` and ``sample_overhead_s``: decode steps' speed, and what serving adds per
      token streamed (framing, HTTP writes, the gateway relaying it -- on a CPU host, CPU taken
      from the engine) -- from a lone stream's TPOT and ``tpot_batch_s``, the TPOT of ``batch``
      streams decoding together on one worker.  Without the batched probe, the lone stream's
      TPOT is all decode speed;
    - ``request_overhead_s``: the fixed latency outside the engines (gateway, HTTP hops, SSE) --
      the short prompt's TTFT minus its steps.

    A per-step overhead cannot be told apart from the decode speed by decode probes (both are
    paid once per step), so it is folded into ``decode_speed``: ``step_overhead_s`` is 0.
    Everything the planner models -- queueing, batching, chunking, interference, routing -- is
    left to the simulation.  ``decode_context`` is the streams' mean context length.
    """
    if not (0 < ttft_short_s < ttft_long_s) or not tpot_s > 0 or not 0 < short_len < long_len:
        raise ValueError(f"need 0 < short TTFT ({ttft_short_s}) < long TTFT ({ttft_long_s}), TPOT > 0 "
                         f"({tpot_s}) and short_len < long_len")
    short, _ = prefill_seconds(cost, short_len, chunk)
    long, _ = prefill_seconds(cost, long_len, chunk)
    speed = (ttft_long_s - ttft_short_s) / (long - short)
    context = decode_context + 1
    decode = cost.step_time(1, 1, 1, context, context)
    # TPOT = decode_speed * decode + sample;  TPOT_batch = decode_speed * decode_batch + batch * sample
    decode_speed, sample = tpot_s / decode, 0.0
    if tpot_batch_s is not None and batch > 1:
        decode_batch = cost.step_time(batch, batch, batch, batch * context, batch * context)
        fitted_speed = (batch * tpot_s - tpot_batch_s) / (batch * decode - decode_batch)
        fitted_sample = tpot_s - fitted_speed * decode
        if fitted_speed > 0 and fitted_sample >= 0:  # else the probes disagree (noise): the lone stream's
            decode_speed, sample = fitted_speed, fitted_sample
    request = request_overhead(cost, ttft_short_s=ttft_short_s, short_len=short_len, chunk=chunk, speed=speed,
                               sample_overhead_s=sample)
    return {"speed": round(speed, 4), "decode_speed": round(decode_speed, 4), "step_overhead_s": 0.0,
            "sample_overhead_s": round(sample, 6), "request_overhead_s": round(request, 5)}


def request_overhead(cost, *, ttft_short_s: float, short_len: int, chunk: int, speed: float,
                     sample_overhead_s: float = 0.0) -> float:
    """The fixed latency outside the engines: a short prompt's TTFT on an idle stack minus its
    prefill steps at ``speed`` (and its first token's streaming)."""
    short, _ = prefill_seconds(cost, short_len, chunk)
    return round(max(0.0, ttft_short_s - sample_overhead_s - speed * short), 5)


def fit_host_effects(*, cold_prefill_slowdown: float, cold_decode_slowdown: float, pause_s: float,
                     contended_ttft_s: float | None = None, predict_contended=None, most: float = 4.0) -> dict:
    """How workers sharing a host's CPUs slow themselves and each other (``HostEffects``), from
    probes of the real stack:

    - ``wake_slowdown``: the mean of how much slower a prompt and a stream ran when sent after
      ``pause_s`` of idle than back to back (each >= 0; ``cold_slowdowns`` computes them);
      ``wake_full_s`` is ``pause_s``;
    - ``host_contention``: the value for which ``predict_contended(contention)`` -- the simulator
      running the contended probe (a long prompt sent while streams decode on every decoding
      worker) with everything else as fitted -- predicts the TTFT measured, ``contended_ttft_s``;
      found by bisection between 0 and ``most``.  The probe runs on a warm stack: its simulation
      should leave the wake-up out.
    """
    if not pause_s > 0:
        raise ValueError(f"pause_s must be > 0, got {pause_s}")
    wake = 0.5 * (max(0.0, cold_prefill_slowdown) + max(0.0, cold_decode_slowdown))
    fitted = {"wake_slowdown": round(wake, 4), "wake_full_s": pause_s, "host_contention": 0.0}
    if contended_ttft_s is None or predict_contended is None:
        return fitted
    low, high = 0.0, most
    if predict_contended(low) >= contended_ttft_s:
        return fitted
    if predict_contended(high) <= contended_ttft_s:
        fitted["host_contention"] = high
        return fitted
    for _ in range(24):
        middle = 0.5 * (low + high)
        if predict_contended(middle) < contended_ttft_s:
            low = middle
        else:
            high = middle
    fitted["host_contention"] = round(0.5 * (low + high), 4)
    return fitted


def cold_slowdowns(cost, *, ttft_long_s: float, ttft_long_cold_s: float, request_overhead_s: float,
                   tpot_s: float, tpot_cold_s: float, decode_context: int, cold_decode_context: int) -> tuple[float, float]:
    """How much slower (a fraction) prefill and decode ran on a stack woken from idle than on a warm
    one: the long prompt's TTFT without the fixed overhead, cold over warm; and a stream's TPOT
    cold over warm, each per calibrated decode step of its own context (the cold stream's prompt
    may be longer)."""
    prefill = (ttft_long_cold_s - request_overhead_s) / (ttft_long_s - request_overhead_s) - 1.0
    warm_step = cost.step_time(1, 1, 1, decode_context + 1, decode_context + 1)
    cold_step = cost.step_time(1, 1, 1, cold_decode_context + 1, cold_decode_context + 1)
    decode = (tpot_cold_s / cold_step) / (tpot_s / warm_step) - 1.0
    return prefill, decode


def host_effects(serving: dict):
    """The simulator's ``HostEffects`` from a calibration's ``serving`` section (none: no effects)."""
    from pdctl.planner.sim_config import HostEffects

    decode_contention = serving.get("host_decode_contention")
    return HostEffects(contention=float(serving.get("host_contention", 0.0)),
                       wake_slowdown=float(serving.get("wake_slowdown", 0.0)),
                       wake_full_s=float(serving.get("wake_full_s", HostEffects.wake_full_s)),
                       decode_contention=None if decode_contention is None else float(decode_contention))


def serving_cost(cost, overheads: dict):
    """The cost model of a step inside a serving worker (``ServingCostModel``) from the fitted
    overheads; ``decode_speed`` defaults to ``speed`` (files from before it existed)."""
    speed = overheads.get("speed", 1.0)
    return ServingCostModel(cost, speed, overheads.get("decode_speed", speed), overheads.get("step_overhead_s", 0.0),
                            overheads.get("sample_overhead_s", 0.0))


def save(document: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(document, indent=2))
