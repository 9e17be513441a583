"""The capacity planner: cost-model fit, traffic and traces, the simulator on the real scheduler and
router, search/sampling, and the pdctl plan/calibrate commands."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from common.engine.scheduler import Scheduler
from common.engine.step_log import step_shape
from gateway.planner.cost_model import FEATURES, LinearCostModel, fit_linear, load_cost_model, roofline
from gateway.planner.hardware import MODELS, parse_link
from gateway.planner.search import estimate_work, simulate, slice_for, splits, thin
from gateway.planner.sim_config import Deployment, EngineSettings, SimConfig
from gateway.planner.simulator import Simulation
from gateway.planner.traffic import LengthDist, Workload, load_trace, synthetic

# A cheap CPU-like step: 3 ms + 40 us per token + 2 us per sequence + 0.1 us per context token.
COST = LinearCostModel((3e-3, 4e-5, 2e-6, 0.0, 0.0, 1e-7))


def config(**engine_changes) -> SimConfig:
    engine = EngineSettings(num_blocks=2048, block_size=16, max_num_batched_tokens=512, max_num_seqs=64,
                            max_model_len=4096)
    engine = dataclasses.replace(engine, **engine_changes)
    return SimConfig(cost=COST, engine=engine, kv_bytes_per_token=4096.0, slo_ttft_s=1.0, slo_tpot_s=0.05)


def workload(rate=4.0, duration=20.0, prompt="uniform:200:600", output="uniform:16:48", seed=1, **kw) -> Workload:
    return synthetic(rate, duration, LengthDist.parse(prompt), LengthDist.parse(output), seed=seed, **kw)


# ---- cost model ------------------------------------------------------------------------------


def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    true = np.array([2e-3, 5e-5, 3e-6, 4e-6, 2e-9, 1e-7])
    tokens = rng.integers(1, 2048, 60)
    seqs = rng.integers(1, 64, 60)
    samples = np.minimum(seqs, rng.integers(0, 64, 60))
    context = tokens + rng.integers(0, 4096, 60)
    pairs = tokens * context.astype(float)
    shapes = np.column_stack([tokens, seqs, samples, pairs, context])
    seconds = true[0] + shapes @ true[1:]
    fitted = fit_linear(shapes, seconds)
    assert np.allclose(fitted.coefficients, true, rtol=1e-6, atol=1e-15)
    assert fitted.fit["max_rel_error"] < 1e-6


def test_fit_never_returns_negative_coefficients():
    rng = np.random.default_rng(1)
    shapes = np.column_stack([rng.integers(1, 512, 40), rng.integers(1, 8, 40), rng.integers(1, 8, 40),
                              rng.random(40) * 1e5, rng.integers(1, 4096, 40)])
    seconds = 1e-3 + 2e-5 * shapes[:, 0] - 1e-7 * shapes[:, 4] + 1e-3  # a "negative" context cost
    fitted = fit_linear(shapes, np.maximum(seconds, 1e-4))
    assert min(fitted.coefficients) >= 0


def test_roofline_decode_is_bandwidth_bound_and_prefill_compute_bound():
    model = roofline("H200", "llama-3-8b")
    spec = MODELS["llama-3-8b"]
    decode = model.step_time(1, 1, 1, 1000, 1000)
    assert decode == pytest.approx(model.gpu.step_overhead_s + (spec.weight_bytes + spec.kv_bytes_per_token * 1001)
                                   / (model.gpu.hbm_bandwidth * model.gpu.mbu))
    prefill = model.step_time(8192, 1, 1, 8192 * 4096.5, 8192)
    assert prefill > 10 * decode  # a full chunk costs many decode steps
    assert model.step_times(np.array([[1, 1, 1, 1000, 1000]]))[0] == pytest.approx(decode)


def test_cost_model_file_round_trip(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"cost_model": COST.to_dict()}))
    assert load_cost_model(path).coefficients == COST.coefficients
    path.write_text(json.dumps({"kind": "linear", "coefficients": [1, -2, 0, 0, 0, 0]}))
    with pytest.raises(ValueError, match=">= 0"):
        load_cost_model(path)
    assert len(FEATURES) == 6


def test_parse_link():
    assert parse_link("ib-ndr").bandwidth == pytest.approx(45e9)
    assert parse_link("12.5").bandwidth == pytest.approx(12.5e9)
    with pytest.raises(ValueError, match="link"):
        parse_link("carrier-pigeon")


# ---- traffic ---------------------------------------------------------------------------------


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert set(LengthDist.parse("fixed:7").sample(rng, 10)) == {7}
    u = LengthDist.parse("uniform:5:9").sample(rng, 1000)
    assert u.min() >= 5 and u.max() <= 9
    assert LengthDist.parse("lognormal:100:0.5").sample(rng, 1000).min() >= 1
    for bad in ("uniform:9:5", "fixed:0", "zipf:1:2", "uniform:a:b"):
        with pytest.raises(ValueError, match="length distribution"):
            LengthDist.parse(bad)


def test_gamma_arrivals_are_burstier_than_poisson():
    poisson = synthetic(50, 200, LengthDist.parse("fixed:8"), LengthDist.parse("fixed:8"), seed=3)
    bursty = synthetic(50, 200, LengthDist.parse("fixed:8"), LengthDist.parse("fixed:8"), "gamma", 3.0, seed=3)
    cv = lambda w: np.diff(w.arrival).std() / np.diff(w.arrival).mean()  # noqa: E731
    assert cv(poisson) == pytest.approx(1.0, abs=0.1)
    assert cv(bursty) > 2.0
    assert len(bursty) == pytest.approx(50 * 200, rel=0.15)


def test_trace_parsing_and_shared_prefixes(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join([
        json.dumps({"timestamp": 1000, "input_length": 1100, "output_length": 20, "hash_ids": [1, 2, 3]}),
        "# a comment",
        json.dumps({"timestamp": 1500, "input_length": 700, "output_length": 5, "hash_ids": [1, 9]}),
        json.dumps({"delay": 250, "input_length": 30, "output_length": 4}),
    ]) + "\n")
    wl = load_trace(path, block_tokens=512)
    assert list(wl.arrival) == [0.0, 0.5, 0.75]
    assert list(wl.prompt_len) == [1100, 700, 30] and list(wl.output_len) == [20, 5, 4]
    a, b, c = (wl.prompt_tokens(i) for i in range(3))
    assert len(a) == 1100 and len(b) == 700 and len(c) == 30
    assert a[:512] == b[:512] and a[512:1024] != b[512:1024]  # hash id 1 shared, then 2 vs 9
    assert set(c).isdisjoint(a)

    path.write_text(json.dumps({"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [1, 2]}) + "\n")
    with pytest.raises(ValueError, match=r"trace.jsonl:1: 2 hash_ids for 100 input tokens"):
        load_trace(path)
    path.write_text('{"timestamp": 0, "output_length": 3}\n')
    with pytest.raises(ValueError, match="input_length"):
        load_trace(path)
    path.write_text('{"timestamp": -5, "input_length": 3, "output_length": 3}\n')
    with pytest.raises(ValueError, match="timestamp must be a number"):
        load_trace(path)


# ---- the simulator drives the real scheduler and router --------------------------------------


def test_simulation_calls_the_real_scheduler(monkeypatch):
    calls = {"schedule": 0, "reserve_remote": 0, "finish_remote": 0}
    for name in calls:
        original = getattr(Scheduler, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Scheduler, name, spy)
    result = Simulation(Deployment(1, 1), workload(duration=5), config()).run()
    assert result["completed"] == result["requests"] > 0
    assert calls["schedule"] > result["requests"]
    assert calls["reserve_remote"] == calls["finish_remote"] == result["remote_prefills"] > 0


def test_scheduler_budget_changes_the_prediction():
    wl = workload(rate=6, prompt="uniform:800:1600")
    small = Simulation(Deployment(1, 1), wl, config(max_num_batched_tokens=128)).run()
    large = Simulation(Deployment(1, 1), wl, config(max_num_batched_tokens=2048)).run()
    # Smaller chunks: more steps, each paying the per-step cost -> later first tokens.
    assert small["prefill_pool"]["steps"] > 2 * large["prefill_pool"]["steps"]
    assert small["ttft_ms"]["p50"] > large["ttft_ms"]["p50"]


def test_tiny_kv_pool_preempts_and_watermark_matters():
    wl = workload(rate=8, duration=10, prompt="uniform:100:200", output="uniform:150:250")
    tiny = Simulation(Deployment(both=1), wl, config(num_blocks=64)).run()
    roomy = Simulation(Deployment(both=1), wl, config(num_blocks=4096)).run()
    assert tiny["preemptions"] > 0 and roomy["preemptions"] == 0
    assert tiny["decode_pool"]["kv_usage_peak"] > roomy["decode_pool"]["kv_usage_peak"]
    held_back = Simulation(Deployment(both=1), wl, config(num_blocks=64, watermark=0.3)).run()
    assert held_back["ttft_ms"]["p50"] != tiny["ttft_ms"]["p50"]


def test_prefix_hits_come_from_the_real_prefix_cache():
    shared = workload(rate=6, prompt="uniform:16:48", prefix_groups=2, prefix_len=1024)
    unique = workload(rate=6, prompt=f"uniform:{16 + 1024}:{48 + 1024}")
    hit = Simulation(Deployment(1, 1), shared, config()).run()
    miss = Simulation(Deployment(1, 1), unique, config()).run()
    # Shared system prompts are found in the prefill worker's cache and on the decode worker,
    # so far less is computed and shipped.
    assert hit["transfer_gb"] < 0.5 * miss["transfer_gb"]
    assert hit["ttft_ms"]["p50"] < miss["ttft_ms"]["p50"]


def test_more_load_is_slower_and_more_decode_gpus_no_worse():
    light = Simulation(Deployment(1, 1), workload(rate=2), config()).run()
    heavy = Simulation(Deployment(1, 1), workload(rate=10), config()).run()
    assert heavy["ttft_ms"]["p50"] > light["ttft_ms"]["p50"]
    wl = workload(rate=8, output="uniform:64:128")
    one = Simulation(Deployment(1, 1), wl, config()).run()
    three = Simulation(Deployment(1, 3), wl, config()).run()
    assert three["tpot_ms"]["p90"] <= one["tpot_ms"]["p90"]


def test_overload_shows_as_missed_slo_and_stops_early():
    wl = workload(rate=200, duration=10)  # ~3x what one prefill worker computes
    cfg = dataclasses.replace(config(), stop_when_failing=True)
    result = Simulation(Deployment(1, 1), wl, cfg).run()
    assert not result["meets_slo"]
    assert result["stopped_early"]


# ---- search and sampling ---------------------------------------------------------------------


def test_large_clusters_are_sampled_with_the_same_ratio():
    piece = slice_for(Deployment(64, 64), work=1e9, budget=1e6)
    assert piece.deployment.prefill == piece.deployment.decode
    assert piece.fraction == pytest.approx(2 / 128) and piece.load_skew == 1.0  # the smallest slice
    assert slice_for(Deployment(2, 6), work=10, budget=100).fraction == 1.0
    wl = workload(rate=50, duration=40)
    part = thin(wl, 0.25)
    assert len(part) == pytest.approx(len(wl) / 4, rel=0.15)


def test_simulate_reports_the_cluster_and_the_slice():
    wl = workload(rate=40, duration=10)
    cfg = config()
    result = simulate(Deployment(8, 8), wl, cfg, budget=estimate_work(wl, cfg) / 6)
    assert result["deployment"] == "8P+8D" and result["gpus"] == 16
    assert result["simulated"]["deployment"] in ("1P+1D", "2P+2D")
    assert result["simulated"]["traffic_fraction"] < 1


def test_splits():
    labels = [d.label for d in splits(4)]
    assert labels == ["1P+3D", "2P+2D", "3P+1D", "4C"]
    many = splits(64, around=20)
    assert Deployment(20, 44) in many and len(many) < 15


# ---- pdctl -----------------------------------------------------------------------------------


def test_pdctl_plan_and_calibrate_help(capsys):
    from gateway.pdctl import main

    for command in ("plan", "calibrate"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--slo-ttft" in text and "--trace" in text and "--threads" in text


def test_pdctl_plan_end_to_end(tmp_path, capsys):
    from gateway.pdctl import main

    out = tmp_path / "plan.json"
    code = main(["plan", "--gpu", "H200", "--model", "llama-3-8b", "--rate", "10", "--duration", "10",
                 "--split", "1:1", "--split", "colocated:2", "--slo-ttft", "1", "--slo-tpot", "0.05",
                 "--out", str(out)])
    assert code == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {c["deployment"] for c in last["candidates"]} == {"1P+1D", "2C"}
    assert last["recommended"]["meets_slo"]
    assert out.exists() and out.with_suffix(".png").stat().st_size > 10_000
    assert main(["plan", "--rate", "1"]) == 2  # neither --gpu nor --calibration


def test_step_shape_of_a_scheduler_output():
    from common.engine.block_pool import BlockPool
    from common.engine.config import SchedulerConfig
    from common.engine.kv_cache_manager import KVCacheManager
    from common.engine.request import Request
    from common.engine.sampling_params import SamplingParams

    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(BlockPool(64), 16))
    s.add_request(Request("a", list(range(100)), SamplingParams(max_tokens=2)))
    out = s.schedule()
    assert step_shape(out.scheduled) == (64, 1, 0, 64 * 32.5, 64)


def test_calibration_fits_measured_engine_steps(served_checkpoint):
    import torch

    from common.engine.config import EngineConfig
    from common.engine.engine import Engine
    from gateway.planner.calibrate import median_by_shape, run_grid

    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model=str(served_checkpoint), device="cpu", num_blocks=256,
                                 max_num_batched_tokens=64, enable_prefix_caching=False), load_tokenizer=False)
    grid = {"prefill": (16, 100), "decode_batch": (1, 3), "decode_context": (8, 40), "mixed": ((2, 8, 80),),
            "repeats": 1, "decode_steps": 2}
    samples = run_grid(engine, grid)
    shapes, seconds = median_by_shape(samples)
    assert len(shapes) >= 6 and all(t > 0 for t in seconds)
    # The engine's own step log holds every step (the warm-up too), with the scheduler's shapes:
    # the 100-token prompt in chunks of 64 and 36.
    rows = engine.step_log.since()
    assert len(rows) == engine.step_log.total > len(samples)
    logged = {tuple(row[2:]) for row in rows}
    assert (64, 1, 0, 64 * 32.5, 64) in logged and (36, 1, 1, 36 * (64 + 18.5), 100) in logged
    assert (rows[:, 1] > 0).all() and (np.diff(rows[:, 0]) >= 0).all()
    fitted = fit_linear(shapes, seconds)
    assert fitted.step_time(*shapes[0]) > 0


# ---- pdctl rebalance by simulation -----------------------------------------------------------


def test_rebalance_by_simulation_moves_towards_the_split_the_traffic_needs():
    from gateway.planner.rebalance import estimated_rate, simulated_plan
    from gateway.rebalance import WorkerReading

    readings = [WorkerReading("p0", "prefill", prefill_tokens_per_s=3000.0)] + [
        WorkerReading(f"d{i}", "decode", num_running=i) for i in range(3)]
    # Long prompts, two-token answers: the prefill pool is the bottleneck.
    wl = workload(rate=3, prompt="uniform:1500:2500", output="fixed:2")
    result = simulated_plan(readings, wl, config(), budget=1e6)
    assert result.prefill_needed > 1
    assert [m.from_role for m in result.moves] == ["decode"] * (result.prefill_needed - 1)
    assert result.moves[0].worker_id == "d0"  # the least-loaded decode worker leaves
    assert any(line.startswith("split 1P+3D") and "(current)" in line for line in result.reasons)
    assert estimated_rate(readings, 1500.0) == pytest.approx(2.0)

    light = workload(rate=0.5, prompt="uniform:100:200", output="uniform:8:16")
    kept = simulated_plan(readings, light, config(), budget=1e6)
    assert kept.moves == [] and "keep 1P+3D" in kept.reasons[-1]


def test_fit_stack_overheads_recovers_speeds_and_overheads():
    from gateway.planner.calibrate import fit_stack_overheads, prefill_seconds, serving_cost

    speed, decode_speed, sample, request, batch = 1.3, 0.8, 0.002, 0.05, 4
    short, _ = prefill_seconds(COST, 16, 512)
    long, long_steps = prefill_seconds(COST, 1000, 512)
    assert long_steps == 2
    decode = COST.step_time(1, 1, 1, 41, 41)
    decode_batch = COST.step_time(batch, batch, batch, batch * 41, batch * 41)
    probes = dict(ttft_short_s=speed * short + sample + request, ttft_long_s=speed * long + sample + request,
                  tpot_s=decode_speed * decode + sample, short_len=16, long_len=1000, chunk=512, decode_context=40)
    fitted = fit_stack_overheads(COST, **probes, tpot_batch_s=decode_speed * decode_batch + batch * sample,
                                 batch=batch)
    assert fitted["speed"] == pytest.approx(speed, rel=1e-3)
    assert fitted["decode_speed"] == pytest.approx(decode_speed, rel=1e-3)
    assert fitted["sample_overhead_s"] == pytest.approx(sample, abs=1e-5)
    assert fitted["request_overhead_s"] == pytest.approx(request, abs=1e-4)
    serving = serving_cost(COST, fitted)
    # A decode step of 8 streams: decode speed, plus eight tokens' overhead.
    shape = (8, 8, 8, 8 * 41, 8 * 41)
    assert serving.step_time(*shape) == pytest.approx(decode_speed * COST.step_time(*shape) + 8 * sample, rel=1e-3)
    # A prefill chunk beside two decodes: prefill speed.
    mixed = (514, 3, 2, 512 * 256.5 + 82, 512 + 82)
    assert serving.step_time(*mixed) == pytest.approx(speed * COST.step_time(*mixed) + 2 * sample, rel=1e-3)
    assert serving.step_times([shape, mixed]) == pytest.approx([serving.step_time(*shape), serving.step_time(*mixed)])
    # Without the batched probe the lone stream's TPOT is all decode speed.
    alone = fit_stack_overheads(COST, **probes)
    assert alone["sample_overhead_s"] == 0.0
    assert serving_cost(COST, alone).step_time(1, 1, 1, 41, 41) == pytest.approx(probes["tpot_s"], rel=1e-3)
    with pytest.raises(ValueError):
        fit_stack_overheads(COST, ttft_short_s=0.5, ttft_long_s=0.4, tpot_s=0.01, short_len=16, long_len=1000,
                            chunk=512, decode_context=40)


def test_serving_cost_model_round_trips_through_its_dict():
    from gateway.planner.cost_model import ServingCostModel, cost_model_from_dict

    model = ServingCostModel(COST, 1.2, 0.9, 0.001, 0.0005)
    again = cost_model_from_dict(json.loads(json.dumps(model.to_dict())))
    assert again.step_time(300, 4, 3, 9000.0, 1200) == pytest.approx(model.step_time(300, 4, 3, 9000.0, 1200))
    with pytest.raises(ValueError):
        ServingCostModel(COST, 0.0, 1.0)


def test_pdctl_rebalance_flags_reach_the_simulation():
    from gateway.pdctl import build_parser
    from gateway.planner.cli import rebalance_by_simulation
    from gateway.rebalance import WorkerReading

    readings = [WorkerReading("p0", "prefill", prefill_tokens_per_s=20_000.0), WorkerReading("d0", "decode"),
                WorkerReading("d1", "decode")]
    args = build_parser().parse_args(["rebalance", "--gpu", "H200", "--model", "llama-3-8b", "--duration", "10",
                                      "--prompt-len", "fixed:1000", "--output-len", "fixed:20", "--tpot-target", "0.05"])
    result = rebalance_by_simulation(readings, args)
    assert "rate estimated from the readings: 20 req/s" in result.reasons[0]
    assert sum(line.startswith("split ") for line in result.reasons) == 2  # 1P+2D and 2P+1D
    assert result.prefill_needed + result.decode_needed == 3


def test_slices_keep_the_per_worker_load():
    # 5:1 has no smaller slice with the same ratio: the whole cluster is simulated.
    assert slice_for(Deployment(5, 1), work=1e9, budget=1e6).fraction == 1.0
    odd = slice_for(Deployment(37, 91), work=1e9, budget=1e6)
    assert odd.load_skew <= 1.1 and odd.fraction < 0.2
    assert slice_for(Deployment(48, 80), work=1e9, budget=1e6).deployment in (Deployment(3, 5), Deployment(6, 10))


# ---- host effects: workers sharing CPUs ------------------------------------------------------


def spaced(prompts, outputs, every=5.0) -> Workload:
    """Requests ``every`` seconds apart: each runs alone on an idle deployment."""
    n = len(prompts)
    return Workload(np.arange(n) * every, np.array(prompts), np.array(outputs))


def test_host_effects_step_time():
    from gateway.planner.sim_config import HostEffects

    host = HostEffects(contention=0.25, wake_slowdown=0.2, wake_full_s=2.0, wake_window_s=0.5)
    assert host.step_time(0.1, 2) == pytest.approx(0.15)
    assert host.step_time(0.1, 0, idle_before_s=1.0) == pytest.approx(0.11)  # half the full idle: half as cold
    assert host.step_time(0.1, 1, idle_before_s=9.0, busy_for_s=0.2) == pytest.approx(0.145)
    assert host.step_time(0.1, 0, idle_before_s=9.0, busy_for_s=0.6) == pytest.approx(0.1)  # warm again
    with pytest.raises(ValueError):
        HostEffects(contention=-0.1)


def test_a_worker_woken_from_idle_runs_cold_for_a_while():
    from gateway.planner.sim_config import HostEffects

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
    from gateway.planner.sim_config import SpeedTrace

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
    from gateway.planner.sim_config import HostEffects

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
    from gateway.planner.sim_config import HostEffects

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
    from gateway.planner.calibrate import fit_host_effects, host_effects
    from gateway.planner.sim_config import HostEffects

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
    from gateway.planner.calibrate import cold_slowdowns

    overhead = 0.005
    warm_step, cold_step = COST.step_time(1, 1, 1, 41, 41), COST.step_time(1, 1, 1, 281, 281)
    prefill, decode = cold_slowdowns(COST, ttft_long_s=overhead + 0.1, ttft_long_cold_s=overhead + 0.12,
                                     request_overhead_s=overhead, tpot_s=1.1 * warm_step, tpot_cold_s=1.1 * 1.3 * cold_step,
                                     decode_context=40, cold_decode_context=280)
    assert prefill == pytest.approx(0.2) and decode == pytest.approx(0.3)


def test_pdctl_plan_reads_host_effects_from_the_calibration(tmp_path):
    from gateway.pdctl import build_parser
    from gateway.planner.cli import build_config

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


# ---- planner validation: judging the best split against noisy measurements -----------------


def test_best_split_is_judged_only_where_the_measurement_can_tell_the_splits_apart():
    from types import SimpleNamespace

    from benchmarks.planner_validation import best_split_at

    args = SimpleNamespace(slo_ttft=1.0, slo_tpot=0.05)
    rng = np.random.default_rng(0)

    def run(split, ttft_s, tpot_s, predicted_ratio):
        per_request = [{"ttft_ms": [None, a * 1e3], "tpot_ms": [None, b * 1e3]} for a, b in zip(ttft_s, tpot_s)]
        measured = max(np.quantile(ttft_s, 0.9) / args.slo_ttft, np.quantile(tpot_s, 0.9) / args.slo_tpot)
        return {"split": split, "per_request": per_request, "predicted": {"slo_ratio": predicted_ratio},
                "measured": {"slo_ratio": measured}}

    ttft, tpot = rng.uniform(0.1, 0.3, 40), rng.uniform(0.004, 0.006, 40)
    # 2C is clearly worse on every request: the measurement is sure, and a wrong ranking disagrees.
    clear = [run("1P+1D", ttft, tpot, 0.3), run("2C", 2 * ttft, 2 * tpot, 0.2)]
    judged = best_split_at(1.0, clear, args)
    assert judged["measured_best"] == "1P+1D" and judged["measured_confidence"] > 0.99
    assert not judged["tie"] and not judged["agrees"]
    clear[1]["predicted"]["slo_ratio"] = 0.4
    assert best_split_at(1.0, clear, args)["agrees"]
    # The same requests measured twice, 1% apart: the measurement cannot tell them apart.
    close = [run("1P+1D", ttft, tpot, 0.3), run("2C", 1.01 * ttft[::-1], tpot[::-1], 0.2)]
    judged = best_split_at(1.0, close, args)
    assert judged["tie"] and judged["agrees"] and judged["measured_confidence"] < 0.9


def test_validation_load_levels_are_fractions_of_the_calibrated_prefill_capacity():
    from benchmarks.planner_validation import capacity_rate

    # 10 ms per step + 1 ms per token: a 90-token prompt takes 0.1 s, one of 190 tokens 0.2 s.
    cost = LinearCostModel((0.01, 1e-3, 0.0, 0.0, 0.0, 0.0))
    assert capacity_rate(cost, "fixed:90", chunk=512) == pytest.approx(10.0)
    # Chunked: 600 tokens in chunks of 512 is two steps.
    assert capacity_rate(cost, "fixed:600", chunk=512) == pytest.approx(1 / 0.62)
    # A distribution: the mean prompt time, not the time of the mean prompt.
    assert 1 / capacity_rate(cost, "uniform:90:190", chunk=512) == pytest.approx(0.15, rel=0.02)


def test_validation_affinity_keys_are_the_gateways_first_block_hashes():
    from benchmarks.loadgen import PlannedRequest
    from benchmarks.planner_validation import affinity_keys
    from common.engine.prefix_hash import block_extra_keys, hash_prompt_blocks

    plan = [PlannedRequest(list(range(3, 40)), 4, 0.0, "planned"), PlannedRequest([5] * 10, 4, 0.0, "planned")]
    keys = affinity_keys(plan, "served-model", 16)
    # What gateway.dispatch.Dispatcher hashes for the router: the model's extra keys, full blocks only.
    assert keys[0] == hash_prompt_blocks(plan[0].prompt, 16, block_extra_keys("served-model"))[0]
    assert keys[0] != affinity_keys(plan, "another-model", 16)[0]
    assert keys[1] == b""  # shorter than a block: no key, as in the gateway
