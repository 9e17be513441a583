"""The capacity planner: cost-model fit, traffic and traces, the simulator on the real scheduler and
router, search/sampling, and the pdctl plan/calibrate commands."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from common.engine.scheduler import Scheduler
from common.engine.step_log import step_shape
from pdctl.planner.cost_model import FEATURES, LinearCostModel, fit_linear, load_cost_model, roofline
from pdctl.planner.hardware import MODELS, parse_link
from pdctl.planner.search import estimate_work, simulate, slice_for, splits, thin
from pdctl.planner.sim_config import Deployment
from pdctl.planner.simulator import Simulation
from pdctl.planner.traffic import LengthDist, load_trace, synthetic
from tests.support.planner_support import COST, config, workload

pytestmark = pytest.mark.slow(seconds=15)  # a long file: scheduled by its length (tests/conftest.py)

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
    from pdctl.cli import main

    for command in ("plan", "calibrate"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--slo-ttft" in text and "--trace" in text and "--threads" in text


def test_pdctl_plan_end_to_end(tmp_path, capsys):
    from pdctl.cli import main

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
    from common.engine.kv.block_pool import BlockPool
    from common.engine.config import SchedulerConfig
    from common.engine.kv.kv_cache_manager import KVCacheManager
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
    from pdctl.planner.calibrate import median_by_shape, run_grid

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
    from pdctl.planner.rebalance_sim import estimated_rate, simulated_plan
    from pdctl.rebalance import WorkerReading

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
    from pdctl.planner.calibrate import fit_stack_overheads, prefill_seconds, serving_cost

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
    from pdctl.planner.cost_model import ServingCostModel, cost_model_from_dict

    model = ServingCostModel(COST, 1.2, 0.9, 0.001, 0.0005)
    again = cost_model_from_dict(json.loads(json.dumps(model.to_dict())))
    assert again.step_time(300, 4, 3, 9000.0, 1200) == pytest.approx(model.step_time(300, 4, 3, 9000.0, 1200))
    with pytest.raises(ValueError):
        ServingCostModel(COST, 0.0, 1.0)


def test_pdctl_rebalance_flags_reach_the_simulation():
    from pdctl.cli import build_parser
    from pdctl.planner.cli import rebalance_by_simulation
    from pdctl.rebalance import WorkerReading

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


# ---- planner validation: judging the best split against noisy measurements -----------------


def test_best_split_is_judged_only_where_the_measurement_can_tell_the_splits_apart():
    from types import SimpleNamespace

    from benchmarks.planner_judging import best_split_at

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
    from benchmarks.planner_probes import affinity_keys
    from common.engine.kv.prefix_hash import block_extra_keys, hash_prompt_blocks

    plan = [PlannedRequest(list(range(3, 40)), 4, 0.0, "planned"), PlannedRequest([5] * 10, 4, 0.0, "planned")]
    keys = affinity_keys(plan, "served-model", 16)
    # What gateway.dispatch.Dispatcher hashes for the router: the model's extra keys, full blocks only.
    assert keys[0] == hash_prompt_blocks(plan[0].prompt, 16, block_extra_keys("served-model"))[0]
    assert keys[0] != affinity_keys(plan, "another-model", 16)[0]
    assert keys[1] == b""  # shorter than a block: no key, as in the gateway


def test_the_planner_takes_the_batch_limits_as_workers_do():
    """A default max_num_seqs is cut to a smaller step budget, and a set one above it is refused --
    as the workers' EngineConfig does: the planner simulated a batch no worker runs, or passed a
    setting every worker refuses."""
    from pdctl.cli import build_parser
    from pdctl.planner.cli import build_config

    def planned(*flags):
        args = build_parser().parse_args(["plan", "--gpu", "H200", "--model", "llama-3-8b", *flags])
        return build_config(args)[0].engine

    engine = planned("--max-num-batched-tokens", "32")
    assert (engine.max_num_batched_tokens, engine.max_num_seqs) == (32, 32)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) must be at least max_num_seqs \(64\)"):
        planned("--max-num-batched-tokens", "32", "--max-num-seqs", "64")
