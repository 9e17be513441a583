"""The planner's host effects: workers sharing a CPU host's cores slow each other and wake cold
from idle (HostEffects), a measured machine's speed replayed (SpeedTrace), and what the simulator
models of the engine thread's timing (a remote prompt waiting for the step in flight)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from pdctl.planner.cost_model import LinearCostModel
from pdctl.planner.sim_config import Deployment
from pdctl.planner.simulator import Simulation
from pdctl.planner.traffic import Workload
from tests.support.planner_support import COST, config


# ---- host effects: workers sharing CPUs ------------------------------------------------------


def spaced(prompts, outputs, every=5.0) -> Workload:
    """Requests ``every`` seconds apart: each runs alone on an idle deployment."""
    n = len(prompts)
    return Workload(np.arange(n) * every, np.array(prompts), np.array(outputs))


def test_host_effects_step_time():
    from pdctl.planner.sim_config import HostEffects

    host = HostEffects(contention=0.25, wake_slowdown=0.2, wake_full_s=2.0, wake_window_s=0.5)
    assert host.step_time(0.1, 2) == pytest.approx(0.15)
    assert host.step_time(0.1, 0, idle_before_s=1.0) == pytest.approx(0.11)  # half the full idle: half as cold
    assert host.step_time(0.1, 1, idle_before_s=9.0, busy_for_s=0.2) == pytest.approx(0.145)
    assert host.step_time(0.1, 0, idle_before_s=9.0, busy_for_s=0.6) == pytest.approx(0.1)  # warm again
    with pytest.raises(ValueError):
        HostEffects(contention=-0.1)


def test_a_worker_woken_from_idle_runs_cold_for_a_while():
    from pdctl.planner.sim_config import HostEffects

    wl = spaced([300, 400, 500], [20, 20, 20])
    base = Simulation(Deployment(both=1), wl, config())
    woken = Simulation(Deployment(both=1), wl, dataclasses.replace(config(), host=HostEffects(wake_slowdown=0.25)))
    short_window = Simulation(Deployment(both=1), wl, dataclasses.replace(
        config(), host=HostEffects(wake_slowdown=0.25, wake_window_s=0.03)))
    for sim in (base, woken, short_window):
        sim.run()
    for i in range(3):
        # Each prompt arrives after seconds of idle: its step runs 25% slower ...
        assert woken.first_token[i] - wl.arrival[i] == pytest.approx(1.25 * (base.first_token[i] - wl.arrival[i]))
        # ... and so do the decode steps inside the window: all of a short stream, the first of a
        # long one.
        stream = base.finish[i] - base.first_token[i]
        assert woken.finish[i] - woken.first_token[i] == pytest.approx(1.25 * stream)
        assert stream < short_window.finish[i] - short_window.first_token[i] < 1.25 * stream
    # Back to back, nothing is cold after the first window.
    busy = Workload(np.zeros(8), np.full(8, 400), np.full(8, 300))
    warm = Simulation(Deployment(both=1), busy, dataclasses.replace(config(), host=HostEffects(wake_slowdown=0.25)))
    warm.run()
    plain = Simulation(Deployment(both=1), busy, config())
    plain.run()
    assert max(warm.finish) - max(plain.finish) < 0.25 * 0.5 + 1e-9


def test_a_speed_trace_replays_a_machine_that_changes_speed():
    from pdctl.planner.sim_config import SpeedTrace

    wl = spaced([300, 400, 500], [20, 20, 20])  # at 0, 5 and 10 s, each alone
    base = Simulation(Deployment(both=1), wl, config())
    # Prefill 2x slower from 4 s on, decode 1.5x slower from 9 s on.
    trace = SpeedTrace((0.0, 4.0, 9.0), (1.0, 2.0, 2.0), (1.0, 1.0, 1.5))
    replayed = Simulation(Deployment(both=1), wl, dataclasses.replace(config(), speed=trace))
    base.run()
    replayed.run()
    ttft = lambda sim, i: sim.first_token[i] - wl.arrival[i]  # noqa: E731
    stream = lambda sim, i: sim.finish[i] - sim.first_token[i]  # noqa: E731
    assert ttft(replayed, 0) == pytest.approx(ttft(base, 0)) and stream(replayed, 0) == pytest.approx(stream(base, 0))
    assert ttft(replayed, 1) == pytest.approx(2 * ttft(base, 1)) and stream(replayed, 1) == pytest.approx(stream(base, 1))
    assert stream(replayed, 2) == pytest.approx(1.5 * stream(base, 2))
    assert trace.factor(-1.0, True) == 1.0 and trace.factor(100.0, False) == 1.5
    for bad in (((0.0, 1.0), (1.0,), (1.0, 1.0)), ((1.0, 0.0), (1.0, 1.0), (1.0, 1.0)), ((0.0,), (0.0,), (1.0,))):
        with pytest.raises(ValueError):
            SpeedTrace(*bad)


def test_a_prompt_sent_beside_a_local_one_is_computed_on_the_other_colocated_worker():
    # Ten pairs of prompts 10 ms apart (long before a heartbeat can show the first), 10 s between
    # pairs.  The gateway counts the first as pending on the worker computing it, so the second is
    # computed on the other one, not queued behind the first.
    prompts = [400, 300] * 10
    arrivals = np.array([10.0 * (k // 2) + 0.01 * (k % 2) for k in range(20)])
    sim = Simulation(Deployment(0, 0, 2), Workload(arrivals, np.array(prompts), np.array([2] * 20)), config())
    sim.run()
    assert all(sim.computed_by[k] != sim.computed_by[k + 1] for k in range(0, 20, 2)), sim.computed_by
    # Among them pairs whose first prompt is computed where it decodes (a local prompt).
    assert any(sim.route_kind[k] == "local" for k in range(0, 20, 2)) and all(sim.computed_by)


def test_a_remote_prompt_waits_for_the_decode_workers_step_in_flight_to_start_not_to_answer():
    # Every step takes 100 ms.  The decode worker streams a short prompt (computed there) from t=0,
    # stepping at 0, 0.1, 0.2, ...; a long prompt (prefilled on the prefill worker) arrives at 0.25.
    # As EngineThread.call runs it, the reservation runs when the step in flight ends (0.3), the
    # prefill worker computes the prompt then (0.3-0.4), and the first token goes out as the KV
    # lands (~0.401, as decode_svc.generate sends it); the request joins the batch at the next step
    # end (0.5), so its second token comes at 0.6.  An idle decode worker reserves at once.
    flat = dataclasses.replace(config(), cost=LinearCostModel((0.1, 0.0, 0.0, 0.0, 0.0, 0.0)))
    landing = 0.4 + 100e-6 + 500 * 4096.0 / 2e9
    busy = Workload(np.array([0.0, 0.25]), np.array([32, 500]), np.array([10, 2]))
    sim = Simulation(Deployment(1, 1), busy, flat)
    sim.run()
    assert sim.route_kind == ["local", "remote"]
    assert sim.first_token[1] == pytest.approx(landing, abs=1e-4)
    assert sim.finish[1] == pytest.approx(0.6, abs=1e-6)
    idle = Simulation(Deployment(1, 1), Workload(np.array([0.25]), np.array([500]), np.array([2])), flat)
    idle.run()
    assert idle.first_token[0] == pytest.approx(0.25 + 0.1 + 100e-6 + 500 * 4096.0 / 2e9, abs=1e-4)
    # A first token that ends the request goes out once it has landed, with the finish.
    one = Simulation(Deployment(1, 1), Workload(np.array([0.0, 0.25]), np.array([32, 500]), np.array([10, 1])), flat)
    one.run()
    assert one.first_token[1] == pytest.approx(0.5, abs=1e-6) and one.finish[1] == pytest.approx(0.5, abs=1e-6)


def test_given_affinity_keys_break_the_routers_ties_as_the_real_prompts_would():
    from gateway.routing import rendezvous

    # Two idle colocated workers: the decode worker is b0 (ties go to the first id) and the prompt
    # is computed where the rendezvous hash of its key prefers -- b0 (local) or b1 (remote).
    keys = [bytes([k]) * 8 for k in range(64)]
    prefers_b0 = next(k for k in keys if rendezvous(k, "b0") > rendezvous(k, "b1"))
    prefers_b1 = next(k for k in keys if rendezvous(k, "b1") > rendezvous(k, "b0"))
    wl = Workload(np.array([0.0]), np.array([400]), np.array([4]))
    routes = []
    for key in (prefers_b0, prefers_b1):
        sim = Simulation(Deployment(0, 0, 2), wl, config(), affinity_keys=[key])
        sim.run()
        routes.append((sim.route_kind[0], sim.computed_by[0]))
    assert routes == [("local", "b0"), ("remote", "b1")]
    with pytest.raises(ValueError):
        Simulation(Deployment(0, 0, 2), wl, config(), affinity_keys=[])


def test_decode_steps_beside_decode_steps_take_their_own_contention():
    from pdctl.planner.sim_config import HostEffects

    # Two colocated workers, one long stream each (short prompts: computed where they decode).
    wl = Workload(np.array([0.0, 0.0]), np.array([32, 32]), np.array([300, 300]))

    def tpot(host):
        sim = Simulation(Deployment(0, 0, 2), wl, dataclasses.replace(config(), host=host))
        sim.run()
        return [(sim.finish[i] - sim.first_token[i]) / 299 for i in range(2)]

    base = tpot(None)
    # Decode beside decode: the pair's own contention, whatever the general one is.
    assert tpot(HostEffects(contention=0.0, decode_contention=0.5)) == pytest.approx([1.5 * t for t in base], rel=0.02)
    assert tpot(HostEffects(contention=0.5, decode_contention=0.0)) == pytest.approx(base, rel=0.02)
    # Not given: every pairing takes ``contention``, as before.
    assert tpot(HostEffects(contention=0.5)) == pytest.approx([1.5 * t for t in base], rel=0.02)
    host = HostEffects(contention=0.1, decode_contention=0.4)
    assert host.step_time(0.1, 2, decode_pairs=1) == pytest.approx(0.1 * (1 + 0.1 + 0.4))
    with pytest.raises(ValueError):
        HostEffects(decode_contention=-0.1)


def test_busy_workers_on_one_host_slow_each_other():
    from pdctl.planner.sim_config import HostEffects

    # A long stream on the decode worker while prompts are computed on the prefill worker.
    wl = Workload(np.array([0.0, 0.05, 5.0]), np.array([32, 500, 500]), np.array([400, 2, 2]))
    base = Simulation(Deployment(1, 1), wl, config())
    shared = Simulation(Deployment(1, 1), wl, dataclasses.replace(config(), host=HostEffects(contention=0.5)))
    base.run(), shared.run()

    def ttft(sim, i):
        return sim.first_token[i] - wl.arrival[i]

    # The prompt sent while the stream decodes is computed 1.5x slower; the one sent after it ends is not.
    assert ttft(shared, 1) > 1.3 * ttft(base, 1)
    assert ttft(shared, 2) == pytest.approx(ttft(base, 2))
    # The stream's steps beside that prompt's were slower too.
    assert shared.finish[0] - shared.first_token[0] > base.finish[0] - base.first_token[0]
    alone = spaced([500, 500], [2, 2])  # never two workers busy at once: no effect
    assert (Simulation(Deployment(1, 1), alone, dataclasses.replace(config(), host=HostEffects(contention=0.5))).run()
            ["ttft_ms"]["p50"] == pytest.approx(Simulation(Deployment(1, 1), alone, config()).run()["ttft_ms"]["p50"]))


def test_fit_host_effects_recovers_contention_by_simulating_the_probe():
    from pdctl.planner.calibrate import fit_host_effects, host_effects
    from pdctl.planner.sim_config import HostEffects

    probe = Workload(np.array([0.0, 0.0, 0.05]), np.array([16, 16, 800]), np.array([200, 200, 2]))

    def contended_ttft(contention):
        sim = Simulation(Deployment(1, 1), probe, dataclasses.replace(config(), host=HostEffects(contention=contention)))
        sim.run()
        return sim.first_token[-1] - probe.arrival[-1]

    fitted = fit_host_effects(cold_prefill_slowdown=0.1, cold_decode_slowdown=0.2, pause_s=2.0,
                              contended_ttft_s=contended_ttft(0.37), predict_contended=contended_ttft)
    assert fitted["host_contention"] == pytest.approx(0.37, abs=0.01)
    assert fitted["wake_slowdown"] == pytest.approx(0.15) and fitted["wake_full_s"] == 2.0
    assert host_effects(fitted) == HostEffects(contention=fitted["host_contention"], wake_slowdown=0.15)
    # Faster than the simulator without contention (noise): none; a negative slowdown counts as none.
    none = fit_host_effects(cold_prefill_slowdown=-0.1, cold_decode_slowdown=0.0, pause_s=1.0,
                            contended_ttft_s=0.5 * contended_ttft(0.0), predict_contended=contended_ttft)
    assert none["host_contention"] == 0.0 and none["wake_slowdown"] == 0.0
    assert host_effects({}) == HostEffects()


def test_cold_slowdowns_compare_like_with_like():
    from pdctl.planner.calibrate import cold_slowdowns

    overhead = 0.005
    warm_step, cold_step = COST.step_time(1, 1, 1, 41, 41), COST.step_time(1, 1, 1, 281, 281)
    prefill, decode = cold_slowdowns(COST, ttft_long_s=overhead + 0.1, ttft_long_cold_s=overhead + 0.12,
                                     request_overhead_s=overhead, tpot_s=1.1 * warm_step, tpot_cold_s=1.1 * 1.3 * cold_step,
                                     decode_context=40, cold_decode_context=280)
    assert prefill == pytest.approx(0.2) and decode == pytest.approx(0.3)


def test_pdctl_plan_reads_host_effects_from_the_calibration(tmp_path):
    from pdctl.cli import build_parser
    from pdctl.planner.cli import build_config

    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"cost_model": COST.to_dict(), "engine": {"kv_bytes_per_token": 4096, "max_model_len": 4096},
                                "serving": {"speed": 1.1, "decode_speed": 0.9, "request_overhead_s": 0.004,
                                            "host_contention": 0.2, "wake_slowdown": 0.15, "wake_full_s": 1.5,
                                            "host_decode_contention": 0.3}}))
    args = build_parser().parse_args(["plan", "--calibration", str(path), "--num-blocks", "512"])
    sim_config, _ = build_config(args)
    assert (sim_config.host.contention, sim_config.host.wake_slowdown, sim_config.host.wake_full_s) == (0.2, 0.15, 1.5)
    assert sim_config.host.decode_contention == 0.3
    assert sim_config.overhead_s == pytest.approx(0.004)
