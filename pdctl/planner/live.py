"""The steps a running deployment's engines ran, read from their step logs, for the planner.

Each worker keeps its last steps (``common.engine.step_log``: when each ended, how long it took,
its shape) and answers ``GET /admin/steps?since=&limit=`` (the gateway proxies it as
``/admin/workers/{id}/steps``).  From these:

- ``pdctl calibrate --live`` fits the cost model to the steps the deployment really ran, on its
  own hardware, under its own traffic (``fit_live``), instead of a grid run on a spare machine;
- ``fit_speeds`` and ``fit_contention`` say how fast the engines ran against a cost model, and how
  much workers sharing a host slowed each other's steps (``HostEffects.contention``);
- ``speed_trace`` follows the machine's speed through a run, window by window, for the simulator
  to replay (``benchmarks/planner_validation.py``).

Every answer is validated before use (``parse_steps_answer``): a worker is a network peer.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Callable

import numpy as np

from common.engine.step_log import COLUMNS
from pdctl.planner.calibrate import median_by_shape
from pdctl.planner.cost_model import CostModel, fit_linear

MAX_PAGES = 200  # pages read from one worker in one fetch (a step log holds about 4 pages)
MAX_STEP_SECONDS = 3600.0
ENGINE_FIELDS = {"block_size": int, "max_num_batched_tokens": int, "max_num_seqs": int, "max_model_len": int,
                 "kv_bytes_per_token": float}


class StepLogError(ValueError):
    """A worker's /admin/steps answer that cannot be used."""


def parse_steps_answer(answer) -> tuple[np.ndarray, dict, bool]:
    """``(rows, engine settings, more)`` of one /admin/steps answer; ``StepLogError`` naming the
    problem if any field is missing, of the wrong type or out of range."""
    if not isinstance(answer, dict):
        raise StepLogError("the answer is not a JSON object")
    if answer.get("columns") != list(COLUMNS):
        raise StepLogError(f"columns {answer.get('columns')!r} differ from {list(COLUMNS)}")
    steps = answer.get("steps")
    if not isinstance(steps, list):
        raise StepLogError("'steps' is not a list")
    try:
        rows = np.asarray(steps, dtype=float).reshape(-1, len(COLUMNS)) if steps else np.zeros((0, len(COLUMNS)))
    except (TypeError, ValueError):
        raise StepLogError(f"'steps' must be rows of {len(COLUMNS)} numbers") from None
    if len(rows) != len(steps):
        raise StepLogError(f"'steps' must be rows of {len(COLUMNS)} numbers")
    if not np.isfinite(rows).all():
        raise StepLogError("a step holds a number that is not finite")
    seconds, tokens, seqs, samples, pairs, context = (rows[:, k] for k in range(1, 7))
    bad = ~((seconds > 0) & (seconds <= MAX_STEP_SECONDS) & (seqs >= 1) & (tokens >= seqs) & (samples >= 0)
            & (samples <= seqs) & (pairs >= 0) & (context >= tokens))
    if bad.any():
        raise StepLogError(f"step {int(np.argmax(bad))} is impossible: {rows[np.argmax(bad)].tolist()}")
    engine = answer.get("engine")
    if not isinstance(engine, dict):
        raise StepLogError("'engine' is not an object")
    settings = {}
    for name, kind in ENGINE_FIELDS.items():
        value = engine.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e12:
            raise StepLogError(f"engine.{name} must be a positive number, got {value!r}")
        settings[name] = kind(value)
    model_id = engine.get("model_id")
    if not isinstance(model_id, str) or not 0 < len(model_id) <= 256:
        raise StepLogError("engine.model_id must be a string of 1-256 characters")
    settings["model_id"] = model_id
    more = answer.get("more", False)
    if not isinstance(more, bool):
        raise StepLogError("'more' must be true or false")
    return rows, settings, more


def fetch_steps(get_page: Callable[[float], dict], since: float) -> tuple[np.ndarray, dict]:
    """Every step a worker logged after ``since`` (unix time), page by page: ``get_page(after)``
    returns one /admin/steps answer.  Returns ``(rows, engine settings)``."""
    pages, engine = [], {}
    for _ in range(MAX_PAGES):
        rows, engine, more = parse_steps_answer(get_page(since))
        pages.append(rows)
        if not more or not len(rows):
            break
        since = float(rows[-1, 0])
    return (np.vstack(pages) if pages else np.zeros((0, len(COLUMNS)))), engine


def _step_kinds(rows: np.ndarray) -> np.ndarray:
    """True for steps that computed prompt tokens (more tokens than requests), False for decode-only."""
    return rows[:, 2] > rows[:, 3]


def fit_live(steps: dict[str, np.ndarray], engines: dict[str, dict], min_steps: int = 50) -> dict:
    """A calibration document (as ``pdctl calibrate`` writes) fitted to workers' logged steps.

    ``steps`` and ``engines`` are by worker id.  The workers must serve one model; steps of the
    same shape keep their median time.  ``warnings`` says where the steps cover the shapes a plan
    needs poorly (no prefill steps, no decode batches): a fit extrapolates there."""
    rows = [r for r in steps.values() if len(r)]
    if not rows:
        raise ValueError("the workers logged no steps in the window: send traffic, or widen --window")
    models = {e["model_id"] for e in engines.values()}
    if len(models) != 1:
        raise ValueError(f"the workers serve different models {sorted(models)}: calibrate one at a time")
    all_rows = np.vstack(rows)
    if len(all_rows) < min_steps:
        raise ValueError(f"only {len(all_rows)} steps logged (need {min_steps}): send more traffic first")
    samples = [(tuple(float(v) for v in row[2:]), float(row[1])) for row in all_rows]
    shapes, seconds = median_by_shape(samples)
    prefill = _step_kinds(all_rows)
    source = {"source": "live", "workers": sorted(steps), "steps": int(len(all_rows)),
              "prefill_steps": int(prefill.sum()), "decode_steps": int((~prefill).sum()),
              "window_s": round(float(all_rows[:, 0].max() - all_rows[:, 0].min()), 1),
              "max_tokens": int(all_rows[:, 2].max()), "max_seqs": int(all_rows[:, 3].max()),
              "fitted_at": round(time.time(), 1)}
    model = fit_linear(shapes, seconds, source)
    warnings = []
    if not prefill.any():
        warnings.append("no prefill steps in the window: prompt costs are extrapolated")
    if (~prefill).sum() == 0:
        warnings.append("no decode-only steps in the window: decode costs are extrapolated")
    elif int(all_rows[~prefill, 3].max()) < 4:
        warnings.append("decode batches of at most 3 requests: larger batches are extrapolated")
    settings = Counter(tuple(sorted(e.items())) for e in engines.values()).most_common(1)[0][0]
    return {"cost_model": model.to_dict(), "engine": dict(settings), "warnings": warnings,
            "points": [{"shape": list(s), "seconds": round(t, 6), "predicted": round(model.step_time(*s), 6)}
                       for s, t in zip(shapes, seconds)]}


IDLE_GAP_S = 0.005  # a gap this long between two of a worker's steps ends a busy period


def _against(rows: np.ndarray, cost: CostModel) -> np.ndarray:
    """Each logged step's measured time over ``cost``'s time for its shape."""
    return rows[:, 1] / np.maximum(cost.step_times(rows[:, 2:]), 1e-9)


def _others_mid_step(steps: dict[str, np.ndarray], name: str) -> tuple[np.ndarray, np.ndarray]:
    """For each of worker ``name``'s steps, how many other workers were mid-step as it started,
    and how many of those were mid decode-only step (their logs share the host's clock)."""
    started = steps[name][:, 0] - steps[name][:, 1]
    count, decoding = np.zeros(len(started)), np.zeros(len(started))
    for other, rows in steps.items():
        if other == name or not len(rows):
            continue
        o_start, o_end = rows[:, 0] - rows[:, 1], rows[:, 0]
        k = np.searchsorted(o_start, started, side="right") - 1
        mid = (k >= 0) & (o_end[np.maximum(k, 0)] > started)
        count += mid
        decoding += mid & ~_step_kinds(rows)[np.maximum(k, 0)]
    return count, decoding


def _busy_periods(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each of a worker's steps, the idle that preceded its busy period (0 for the log's
    first) and how long into that period it started."""
    started, ended = rows[:, 0] - rows[:, 1], rows[:, 0]
    gaps = np.concatenate([[np.inf], started[1:] - ended[:-1]])
    period = np.maximum.accumulate(np.where(gaps > IDLE_GAP_S, np.arange(len(rows)), 0))
    return np.where(np.isinf(gaps[period]), 0.0, gaps[period]), started - started[period]


def _inside(rows: np.ndarray, windows: list[tuple[float, float]]) -> np.ndarray:
    """Steps that ended inside any of ``windows`` (wall-clock start, end)."""
    mask = np.zeros(len(rows), bool)
    for a, b in windows:
        mask |= (rows[:, 0] > a) & (rows[:, 0] <= b)
    return mask


def _weighted_median(values: list[tuple[float, float]]) -> float:
    """The median of ``(value, weight)`` pairs."""
    slowdowns, weights = np.array([v for v, _ in values]), np.array([w for _, w in values], float)
    order = np.argsort(slowdowns)
    cumulative = np.cumsum(weights[order])
    return float(slowdowns[order][np.searchsorted(cumulative, cumulative[-1] / 2)])


def fit_speeds(steps: dict[str, np.ndarray], cost: CostModel, windows: list[tuple[float, float]],
               min_steps: int = 3, waking: tuple[float, float] = (0.5, 0.5)) -> dict:
    """How fast the engines ran against ``cost`` in ``windows``: the median of measured / predicted
    time over the steps that started while no other worker was mid-step, each step weighted by
    its predicted time, for prefill and for decode-only steps (None with fewer than
    ``min_steps``) -- a serving cost model's speeds, with host contention left to
    ``fit_contention``.  Weighted by time, the speed is that of an engine-second: the cost
    model's error differs between shapes (on the validation host a lone 80-token prompt's step
    ran ~1.2x the model, a 512-token one ~1.05x), and what a load's queues feel is its long
    steps, not the count of short ones.  Steps a worker ran waking up -- in the first
    ``waking[1]`` seconds of a busy period that followed at least ``waking[0]`` seconds of idle
    -- are left out: the simulator slows those by ``HostEffects.wake_slowdown`` on top."""
    ratios = {"prefill": [], "decode": []}
    weights = {"prefill": [], "decode": []}
    for name, rows in steps.items():
        if not len(rows):
            continue
        idle, busy_for = _busy_periods(rows)
        awake = (idle < waking[0]) | (busy_for >= waking[1])
        chosen = _inside(rows, windows) & (_others_mid_step(steps, name)[0] == 0) & awake
        predicted = np.maximum(cost.step_times(rows[:, 2:]), 1e-9)
        ratio = rows[:, 1] / predicted
        prefill = _step_kinds(rows)
        for kind, mask in (("prefill", chosen & prefill), ("decode", chosen & ~prefill)):
            ratios[kind].append(ratio[mask])
            weights[kind].append(predicted[mask])
    out = {}
    for kind, parts in ratios.items():
        values = np.concatenate(parts) if parts else np.zeros(0)
        weight = np.concatenate(weights[kind]) if parts else np.zeros(0)
        out[kind] = round(_weighted_median(list(zip(values, weight))), 4) if len(values) >= min_steps else None
        out[f"{kind}_steps"] = int(len(values))
    return out


def step_residuals(steps: dict[str, np.ndarray], cost: CostModel, host=None) -> dict[str, np.ndarray]:
    """Per worker, each logged step's measured time over what the simulator would give it: the cost
    model's time, times the host effects (``HostEffects``) of the moment it started -- how many
    other workers were mid-step (from their logs: workers on one host share a clock) and how long
    the worker had been idle before its busy period.  1.0 where the model and the machine agree."""
    out = {}
    for name, rows in steps.items():
        if not len(rows):
            out[name] = np.zeros(0)
            continue
        expected = cost.step_times(rows[:, 2:])
        if host is not None:
            others, decoding = _others_mid_step(steps, name)
            pairs = np.where(_step_kinds(rows), 0, decoding)  # a decode-only step beside decode-only ones
            idle, busy_for = _busy_periods(rows)
            expected = np.array([host.step_time(e, int(o), i, b, int(p))
                                 for e, o, i, b, p in zip(expected, others, idle, busy_for, pairs)])
        out[name] = rows[:, 1] / np.maximum(expected, 1e-9)
    return out


def speed_trace(steps: dict[str, np.ndarray], cost: CostModel, *, reference: list[tuple[float, float]],
                load: tuple[float, float], window_s: float = 10.0, min_steps: int = 5, host=None):
    """How fast the engines ran during ``load`` (wall-clock start and end) compared with during the
    ``reference`` windows (the probes the cost model was fitted to), in windows of ``window_s``:
    the median residual (``step_residuals``) of the window's prefill and decode-only steps over the
    reference's.  A window with fewer than ``min_steps`` of a kind takes the whole load's factor
    for it (1.0 where the load had none either).  Returns ``(SpeedTrace in seconds from the load's
    start, summary)``."""
    from pdctl.planner.sim_config import SpeedTrace

    residuals = step_residuals(steps, cost, host)
    ended = np.concatenate([rows[:, 0] for rows in steps.values()]) if steps else np.zeros(0)
    ratio = np.concatenate(list(residuals.values())) if steps else np.zeros(0)
    prefill = np.concatenate([_step_kinds(rows) for rows in steps.values()]) if steps else np.zeros(0, bool)
    in_reference = np.concatenate([_inside(rows, reference) for rows in steps.values()]) if steps else np.zeros(0, bool)
    start, end = load
    in_load = (ended > start) & (ended <= end)

    def median(mask) -> float | None:
        return float(np.median(ratio[mask])) if mask.sum() >= min_steps else None

    base, whole = {}, {}
    for kind, mask in (("prefill", prefill), ("decode", ~prefill)):
        base[kind] = median(in_reference & mask)
        load_median = median(in_load & mask)
        whole[kind] = load_median / base[kind] if base[kind] and load_median else 1.0
    starts, factors = [], {"prefill": [], "decode": []}
    t = start
    while t < end or not starts:
        window = in_load & (ended > t) & (ended <= t + window_s)
        starts.append(round(t - start, 3))
        for kind, mask in (("prefill", prefill), ("decode", ~prefill)):
            value = median(window & mask)
            factors[kind].append(round(value / base[kind], 4) if value and base[kind] else round(whole[kind], 4))
        t += window_s
    trace = SpeedTrace(tuple(starts), tuple(factors["prefill"]), tuple(factors["decode"]))
    summary = {"prefill": round(whole["prefill"], 4), "decode": round(whole["decode"], 4),
               "reference_residual": {k: None if v is None else round(v, 4) for k, v in base.items()},
               "load_steps": int(in_load.sum()), "reference_steps": int(in_reference.sum()),
               "windows": {"starts_s": list(starts), "prefill": factors["prefill"], "decode": factors["decode"]}}
    return trace, summary


def fit_contention(steps: dict[str, np.ndarray], cost: CostModel, windows: list[tuple[float, float]],
                   min_steps: int = 3) -> dict:
    """``HostEffects.contention`` and ``decode_contention`` from workers' step logs on one host:
    how much slower a step ran when another worker was mid-step as it started (as the simulator
    applies them) than when none was, against ``cost``.  Compared within each worker and kind of
    step (prefill, decode-only), over the steps that ended inside ``windows`` (wall-clock), apart
    for a decode-only step beside decode-only ones (``decode_contention``: both memory-bound) and
    every other pairing (``contention``); each one's groups are combined by a median weighted by
    their contended steps.  Either is None where no group had ``min_steps`` steps each way."""
    found = {"contention": [], "decode_contention": []}
    groups = []
    for name, rows in steps.items():
        if not len(rows):
            continue
        inside = _inside(rows, windows)
        others, decoding = _others_mid_step(steps, name)
        residual = _against(rows, cost)
        prefill = _step_kinds(rows)
        pairs = ~prefill & (decoding > 0)
        for kind, mask in (("prefill", prefill), ("decode", ~prefill)):
            alone = residual[inside & mask & (others == 0)]
            for key, beside in (("contention", (others > 0) & ~pairs), ("decode_contention", pairs)):
                contended = residual[inside & mask & beside]
                if len(alone) >= min_steps and len(contended) >= min_steps:
                    slowdown = float(np.median(contended) / np.median(alone) - 1.0)
                    found[key].append((slowdown, len(contended)))
                    groups.append({"worker": name, "kind": kind, "fits": key, "slowdown": round(slowdown, 4),
                                   "alone": int(len(alone)), "contended": int(len(contended))})
    out = {"groups": groups}
    for key, values in found.items():
        out[key] = round(max(0.0, _weighted_median(values)), 4) if values else None
    return out
