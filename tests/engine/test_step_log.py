"""The engine's step log and what the planner makes of a worker's answer: the ring buffer, paging,
hostile answers refused, a live fit recovering the cost model the steps were drawn from."""
from __future__ import annotations

import numpy as np
import pytest

from common.engine.step_log import COLUMNS, StepLog
from pdctl.planner.cost_model import LinearCostModel
from pdctl.planner.live import StepLogError, fetch_steps, fit_live, parse_steps_answer

ENGINE = {"model_id": "m", "dtype": "float32", "block_size": 16, "kv_bytes_per_token": 4096.0,
          "max_num_batched_tokens": 512, "max_num_seqs": 64, "max_model_len": 2048}
TRUE = LinearCostModel((2e-3, 5e-5, 1e-5, 3e-5, 2e-9, 4e-8))


def shape(tokens, seqs, context):
    return (tokens, seqs, seqs, tokens * context / 2, context)


def test_ring_keeps_the_newest_steps_in_order():
    log = StepLog(capacity=4)
    for k in range(6):
        log.record(100.0 + k, 0.01 * (k + 1), shape(1, 1, 10 + k))
    rows = log.since()
    assert len(log) == 4 and log.total == 6
    assert rows[:, 0].tolist() == [102.0, 103.0, 104.0, 105.0]  # the two oldest were overwritten
    assert rows[0, 1] == pytest.approx(0.03) and rows[-1, 6] == 15
    assert log.since(103.0)[:, 0].tolist() == [104.0, 105.0]
    assert log.since(101.0, limit=1)[:, 0].tolist() == [102.0]  # the oldest first: page on from it
    assert StepLog(capacity=2).since().shape == (0, len(COLUMNS))
    with pytest.raises(ValueError):
        StepLog(capacity=0)


def answer(rows, more=False, **changes):
    body = {"columns": list(COLUMNS), "steps": [list(r) for r in rows], "more": more, "engine": dict(ENGINE)}
    body.update(changes)
    return body


def test_paging_reads_every_step_once():
    log = StepLog(capacity=100)
    for k in range(25):
        log.record(1000.0 + k, 0.01, shape(1, 1, 10))
    pages = []

    def get_page(after):
        rows = log.since(after, 11)
        pages.append(after)
        return answer(rows[:10].tolist(), more=len(rows) > 10)

    rows, engine = fetch_steps(get_page, 1004.5)
    assert rows[:, 0].tolist() == [1005.0 + k for k in range(20)]
    assert len(pages) == 2 and engine["block_size"] == 16


@pytest.mark.parametrize("bad, message", [
    ("not an object", "not a JSON object"),
    (answer([[1, 0.01, 1, 1, 1, 1]]), "rows of 7 numbers"),
    (answer([[1, 0.01, 1, 1, 1, 1, "x"]]), "rows of 7 numbers"),
    (answer([[1, float("nan"), 1, 1, 1, 1, 1]]), "not finite"),
    (answer([[1, -0.01, 1, 1, 1, 1, 1]]), "impossible"),
    (answer([[1, 0.01, 1, 2, 1, 1, 1]]), "impossible"),  # fewer tokens than requests
    (answer([[1, 0.01, 4, 1, 2, 1, 4]]), "impossible"),  # more samples than requests
    (answer([[1, 0.01, 8, 1, 1, 1, 4]]), "impossible"),  # reads less context than it computes
    (answer([], columns=["a"]), "columns"),
    (answer([], steps={"a": 1}), "not a list"),
    (answer([], engine={**ENGINE, "block_size": -16}), "engine.block_size"),
    (answer([], engine={**ENGINE, "max_model_len": True}), "engine.max_model_len"),
    (answer([], engine={**ENGINE, "model_id": ""}), "engine.model_id"),
    (answer([], more="yes"), "'more'"),
])
def test_a_hostile_answer_is_refused_naming_the_problem(bad, message):
    with pytest.raises(StepLogError, match=message):
        parse_steps_answer(bad)


def logged_steps(cost, seed, speed=1.0, n=300):
    """Steps of a serving mix: prefill chunks and decode batches, times from ``cost`` with 3% noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(n):
        if rng.random() < 0.3:
            s = shape(int(rng.integers(16, 512)), 1, int(rng.integers(16, 1024)))
        else:
            b = int(rng.integers(1, 32))
            s = shape(b, b, b * int(rng.integers(32, 1024)))
        t = speed * cost.step_time(*s) * (1 + 0.03 * rng.standard_normal())
        rows.append((1000.0 + k, t, *s))
    return np.array(rows)


def test_a_live_fit_recovers_the_cost_of_the_steps():
    steps = {"p0": logged_steps(TRUE, 1), "d0": logged_steps(TRUE, 2)}
    doc = fit_live(steps, {"p0": ENGINE, "d0": ENGINE})
    fitted = LinearCostModel(tuple(doc["cost_model"]["coefficients"]))
    check = logged_steps(TRUE, 3)  # unseen steps
    ratio = fitted.step_times(check[:, 2:]) / TRUE.step_times(check[:, 2:])
    assert np.median(np.abs(ratio - 1)) < 0.05
    fit = doc["cost_model"]["fit"]
    assert fit["source"] == "live" and fit["workers"] == ["d0", "p0"] and fit["steps"] == 600
    assert fit["prefill_steps"] + fit["decode_steps"] == 600 and fit["prefill_steps"] > 0
    assert doc["engine"]["block_size"] == 16 and doc["warnings"] == []


def test_a_live_fit_refuses_too_little_and_mixed_models_and_warns_on_gaps():
    with pytest.raises(ValueError, match="no steps"):
        fit_live({"d0": np.zeros((0, 7))}, {"d0": ENGINE})
    with pytest.raises(ValueError, match="only 10 steps"):
        fit_live({"d0": logged_steps(TRUE, 1, n=10)}, {"d0": ENGINE})
    with pytest.raises(ValueError, match="different models"):
        fit_live({"a": logged_steps(TRUE, 1), "b": logged_steps(TRUE, 2)}, {"a": ENGINE, "b": {**ENGINE, "model_id": "n"}})
    decode_only = logged_steps(TRUE, 4)
    decode_only = decode_only[decode_only[:, 2] == decode_only[:, 3]]
    doc = fit_live({"d0": decode_only}, {"d0": ENGINE})
    assert any("no prefill steps" in w for w in doc["warnings"])


def test_residuals_apply_the_host_effects_of_the_moment_each_step_started():
    from pdctl.planner.live import step_residuals
    from pdctl.planner.sim_config import HostEffects

    flat = LinearCostModel((0.1, 0, 0, 0, 0, 0))  # every step 100 ms by the model
    host = HostEffects(contention=0.5, wake_slowdown=1.0, wake_full_s=2.0, wake_window_s=0.5)
    # a: one step from 10.0 to 10.1.  b: a step starting at 10.05 while a is mid-step (x1.5); one
    # at 13.0 after 2.85 s idle (x2: awake for 0 s); two more back to back, 0.2 and 0.4 s into the
    # busy period (x2: still in the 0.5 s wake window); then one 0.6 s into it (x1).
    a = np.array([[10.1, 0.1, 1, 1, 1, 1, 1]])
    b = np.array([[10.2, 0.15, 1, 1, 1, 1, 1], [13.2, 0.2, 1, 1, 1, 1, 1], [13.4, 0.2, 1, 1, 1, 1, 1],
                  [13.6, 0.2, 1, 1, 1, 1, 1], [13.7, 0.1, 1, 1, 1, 1, 1]])
    residuals = step_residuals({"a": a, "b": b}, flat, host)
    assert residuals["a"].tolist() == pytest.approx([1.0])
    assert residuals["b"].tolist() == pytest.approx([1.0] * 5)
    assert step_residuals({"a": a, "b": b}, flat)["b"].tolist() == pytest.approx([1.5, 2.0, 2.0, 2.0, 1.0])


def test_speed_trace_replays_how_fast_the_engines_ran_in_each_window():
    from pdctl.planner.live import speed_trace

    rng = np.random.default_rng(7)
    rows, t = [], 0.0
    for speed, until in ((1.0, 20.0), (1.25, 30.0), (0.8, 40.0)):  # probes, then two 10 s windows of load
        while t < until:
            s = shape(64, 1, 64) if rng.random() < 0.3 else shape(4, 4, 400)
            seconds = speed * TRUE.step_time(*s)
            t += seconds + 0.001
            rows.append((t, seconds, *s))
    trace, summary = speed_trace({"w": np.array(rows)}, TRUE, reference=[(0.0, 20.0)], load=(20.0, 40.0))
    assert trace.starts == (0.0, 10.0)
    assert trace.factor(5.0, True) == pytest.approx(1.25, rel=0.02) and trace.factor(15.0, False) == pytest.approx(0.8, rel=0.02)
    assert trace.factor(99.0, True) == pytest.approx(0.8, rel=0.02)  # after the last window, its speed holds
    assert summary["reference_steps"] > 100 and summary["load_steps"] > 100
    # Too few steps of a kind in a window: the whole load's factor for that kind.
    _, sparse = speed_trace({"w": np.array(rows)}, TRUE, reference=[(0.0, 20.0)], load=(20.0, 40.0), min_steps=10**6)
    assert sparse["windows"]["prefill"] == [1.0, 1.0]


def two_workers_on_one_host(contention: float, speed: float, seed: int = 0, decode_contention: float | None = None):
    """Two workers' logs: b runs a 1 s step every other second, a prompt's and a decode-only one
    in turn; a steps throughout (prompt and decode steps, now and then after a pause),
    ``1 + contention`` times longer when it starts one while b is mid-step -- ``1 +
    decode_contention`` for a decode-only step while b is mid decode-only step (default:
    ``contention``); a runs at ``speed`` times the model."""
    decode_contention = contention if decode_contention is None else decode_contention
    rng = np.random.default_rng(seed)
    b = np.array([(2.0 * k + 1.0, 1.0, *(shape(512, 1, 512) if k % 2 == 0 else shape(32, 32, 4000)))
                  for k in range(30)])
    rows, t = [], 0.05
    while t < 60.0:
        prefill = rng.random() < 0.3
        s = shape(64, 1, 64) if prefill else shape(2, 2, 200)
        overlapped = int(t) % 2 == 0  # b is mid-step from 2k to 2k + 1
        b_decoding = (int(t) // 2) % 2 == 1
        slowdown = decode_contention if (b_decoding and not prefill) else contention
        seconds = speed * TRUE.step_time(*s) * (1 + slowdown * overlapped) * (1 + 0.02 * rng.standard_normal())
        rows.append((t + seconds, seconds, *s))
        t += seconds + (0.0002 if rng.random() < 0.9 else 0.3)
    return {"a": np.array(rows), "b": b}


def test_contention_and_speeds_are_measured_on_the_steps():
    from pdctl.planner.live import fit_contention, fit_speeds

    steps = two_workers_on_one_host(contention=0.25, speed=1.2)
    fitted = fit_contention(steps, TRUE, [(0.0, 60.0)])
    assert fitted["contention"] == pytest.approx(0.25, abs=0.03)
    assert {(g["worker"], g["kind"]) for g in fitted["groups"]} >= {("a", "prefill"), ("a", "decode")}
    speeds = fit_speeds(steps, TRUE, [(0.0, 60.0)])
    assert speeds["prefill"] == pytest.approx(1.2, rel=0.03) and speeds["decode"] == pytest.approx(1.2, rel=0.03)
    # Without contention: none found; outside the windows: nothing to go on.
    assert fit_contention(two_workers_on_one_host(0.0, 1.0, seed=1), TRUE, [(0.0, 60.0)])["contention"] < 0.03
    assert fit_contention(steps, TRUE, [(100.0, 200.0)])["contention"] is None
    assert fit_speeds(steps, TRUE, [(100.0, 200.0)])["decode"] is None


def test_speeds_leave_out_the_steps_a_worker_ran_waking_up():
    from pdctl.planner.live import fit_speeds

    # Busy 0.8 s, idle 1 s, over and over; the first 0.5 s of each busy period runs 1.6x slower (cold).
    rng = np.random.default_rng(3)
    rows, t = [], 0.0
    for period in range(20):
        start = t
        while t < start + 0.8:
            s = shape(64, 1, 64) if rng.random() < 0.3 else shape(2, 2, 200)
            seconds = TRUE.step_time(*s) * (1.6 if t - start < 0.5 else 1.0)
            rows.append((t + seconds, seconds, *s))
            t += seconds + 0.0002
        t += 1.0
    steps = {"w": np.array(rows)}
    warm = fit_speeds(steps, TRUE, [(0.0, t)])
    assert warm["prefill"] == pytest.approx(1.0, abs=0.01) and warm["decode"] == pytest.approx(1.0, abs=0.01)
    # Counted in, most of the steps are cold ones: the speed would take the wake-up in twice.
    everything = fit_speeds(steps, TRUE, [(0.0, t)], waking=(np.inf, 0.0))
    assert everything["decode_steps"] > 2 * warm["decode_steps"] and everything["decode"] > 1.3


def test_decode_steps_beside_decode_steps_are_fitted_apart():
    from pdctl.planner.live import fit_contention, step_residuals
    from pdctl.planner.sim_config import HostEffects

    steps = two_workers_on_one_host(contention=0.05, speed=1.0, decode_contention=0.3, seed=2)
    fitted = fit_contention(steps, TRUE, [(0.0, 60.0)])
    assert fitted["contention"] == pytest.approx(0.05, abs=0.03)
    assert fitted["decode_contention"] == pytest.approx(0.3, abs=0.03)
    assert {g["fits"] for g in fitted["groups"] if g["worker"] == "a" and g["kind"] == "decode"} == {
        "contention", "decode_contention"}
    # The simulator's view of each step with both applied leaves a's steps at the model's speed.
    host = HostEffects(contention=fitted["contention"], decode_contention=fitted["decode_contention"])
    assert np.median(step_residuals(steps, TRUE, host)["a"]) == pytest.approx(1.0, abs=0.03)
    assert np.percentile(step_residuals(steps, TRUE, host)["a"], 90) < 1.1
    assert np.percentile(step_residuals(steps, TRUE, HostEffects(contention=0.05))["a"], 90) > 1.2
    # One worker alone has no pairs to fit.
    assert fit_contention({"a": steps["a"]}, TRUE, [(0.0, 60.0)])["decode_contention"] is None
