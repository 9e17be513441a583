"""The planner with tensor parallelism per pool: a worker of N GPUs computes and reads its share,
pays its collectives, holds KV for its ranks' heads; the search tries each pool at every TP size
and skips workers that cannot hold the model."""
from __future__ import annotations

import json

import pytest

from pdctl.planner.cost_model import roofline
from pdctl.planner.hardware import GPUS, MODELS, kv_blocks_per_gpu
from pdctl.planner.search import fits, splits
from pdctl.planner.sim_config import Deployment, EngineSettings, SimConfig

H200 = GPUS["H200"]


def test_tp_splits_the_work_and_adds_collectives():
    base = roofline("H200", "llama-3.1-70b")
    tp1, tp2, tp8 = base, base.with_tp(2), base.with_tp(8)
    decode = (32, 32, 32, 32 * 2000, 32 * 2000)
    prefill = (4096, 1, 1, 4096 * 2048, 4096)
    assert tp2.step_time(*decode) < tp1.step_time(*decode), "half the weights read per rank"
    assert tp2.step_time(*prefill) < 0.6 * tp1.step_time(*prefill), "half the FLOPs per rank"
    assert tp8.collective_seconds(*decode[:1], decode[2]) > tp2.collective_seconds(decode[0], decode[2])
    ideal = (tp1.step_time(*decode) - H200.step_overhead_s) / 8 + H200.step_overhead_s
    assert tp8.step_time(*decode) > ideal, "collectives keep TP from scaling perfectly"


def test_a_worker_of_more_gpus_holds_more_kv_and_replicated_heads_cost_each_rank():
    spec = MODELS["llama-3.1-70b"]
    with pytest.raises(ValueError, match="no room for KV on 1 x H200"):
        kv_blocks_per_gpu(H200, spec, 16)
    assert kv_blocks_per_gpu(H200, spec, 16, tp=4) > 2 * kv_blocks_per_gpu(H200, spec, 16, tp=2)
    gemma = MODELS["gemma-3-270m"]  # one kv head: every rank holds it
    assert gemma.rank_kv_bytes_per_token(4) == gemma.kv_bytes_per_token
    assert gemma.worker_kv_bytes_per_token(4) == 4 * gemma.kv_bytes_per_token
    with pytest.raises(ValueError, match="does not divide"):
        MODELS["llama-3.1-70b"].rank_kv_heads(3)


def test_splits_give_each_pool_every_tp_size_that_fills_its_gpus():
    labels = {d.label for d in splits(8, tp_sizes=(1, 2, 4))}
    assert {"1Px4+2Dx2", "2Px2+1Dx4", "4P+2Dx2", "2Cx4", "8C"} <= labels
    assert all(d.gpus == 8 for d in splits(8, tp_sizes=(1, 2, 4)))
    assert [d.label for d in splits(4)] == ["1P+3D", "2P+2D", "3P+1D", "4C"], "one GPU per worker unless asked"


def test_workers_that_cannot_hold_the_model_are_skipped_and_tp_needs_a_gpu_profile():
    cost = roofline("H200", "llama-3.1-70b")
    config = SimConfig(cost=cost, engine=EngineSettings(num_blocks=1000), blocks_from_memory=True)
    assert "no room for KV" in fits(Deployment(1, 1), config)
    assert fits(Deployment(1, 1, prefill_tp=2, decode_tp=4), config) is None
    assert config.settings_for("decode", 4).num_blocks == kv_blocks_per_gpu(H200, MODELS["llama-3.1-70b"], 16, tp=4)
    from tests.support.planner_support import config as calibrated

    with pytest.raises(ValueError, match="GPU profile"):
        calibrated().cost_for(2)


def test_pdctl_plan_answers_with_a_split_of_tp_workers(capsys):
    from pdctl.cli import main

    code = main(["plan", "--gpu", "H200", "--model", "llama-3.1-70b", "--rate", "2", "--duration", "10",
                 "--prompt-len", "uniform:512:1024", "--output-len", "uniform:16:64", "--gpus", "8",
                 "--tp-sizes", "1,2,4", "--no-colocated", "--slo-ttft", "2", "--slo-tpot", "0.1"])
    assert code == 0
    out = capsys.readouterr().out
    last = json.loads(out.strip().splitlines()[-1])
    best = last["recommended"]
    assert best is not None and best["prefill_tp"] > 1 and best["decode_tp"] > 1, "70B needs 2+ H200s per worker"
    assert best["prefill"] * best["prefill_tp"] + best["decode"] * best["decode_tp"] == 8
    assert "4P+4D: skipped" in out, "one-GPU workers cannot hold 70B: said, not simulated"
    assert all(c["prefill_tp"] > 1 and c["decode_tp"] > 1 for c in last["candidates"])
    code = main(["plan", "--gpu", "H200", "--model", "llama-3.1-70b", "--rate", "1", "--duration", "5",
                 "--split", "1x4:2x2", "--quiet"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["candidates"][0]["deployment"] == "1Px4+2Dx2"
