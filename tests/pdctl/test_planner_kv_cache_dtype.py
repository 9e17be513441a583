"""The planner under the workers' ``--kv-cache-dtype``: with a GPU profile, a token's KV takes the cache
dtype's bytes -- in the memory that sizes each worker's pool, on the link to the decode worker, and in
what a decode step reads --; a calibration measured its workers' own cache, so the flag goes with
``--gpu`` only (and ``pdctl calibrate`` takes it, to measure workers that run with it)."""
from __future__ import annotations

import json

import pytest
import torch

from common.engine.config import KV_CACHE_DTYPES
from common.engine.kv.kv_cache import dtype_from_name
from pdctl.cli import build_parser
from pdctl.planner.cli import build_config
from pdctl.planner.hardware import GPUS, KV_CACHE_DTYPE_BYTES, MODELS, kv_blocks_per_gpu
from tests.support.planner_support import COST


def test_the_planners_byte_sizes_are_the_engines():
    assert set(KV_CACHE_DTYPE_BYTES) == set(KV_CACHE_DTYPES) - {"auto"}
    for name, nbytes in KV_CACHE_DTYPE_BYTES.items():
        assert torch.empty((), dtype=dtype_from_name(name)).element_size() == nbytes


def test_an_fp8_cache_halves_a_bf16_models_kv_and_doubles_its_pool():
    spec = MODELS["llama-3-8b"]  # bf16 weights
    fp8 = spec.with_kv_cache_dtype("fp8")
    assert spec.with_kv_cache_dtype("auto") is spec
    assert fp8.kv_bytes_per_token * 2 == spec.kv_bytes_per_token == spec.with_kv_cache_dtype("bfloat16").kv_bytes_per_token
    assert fp8.weight_bytes == spec.weight_bytes
    blocks = {s.kv_dtype_bytes: kv_blocks_per_gpu(GPUS["H200"], s, 16) for s in (spec, fp8)}
    assert blocks[1] in (2 * blocks[None], 2 * blocks[None] + 1)


def test_plan_with_a_gpu_takes_the_flag_into_memory_link_and_steps():
    def planned(*flags):
        args = build_parser().parse_args(["plan", "--gpu", "H200", "--model", "llama-3-8b", *flags])
        return build_config(args)[0]

    auto, fp8 = planned(), planned("--kv-cache-dtype", "fp8")
    assert fp8.kv_bytes_per_token * 2 == auto.kv_bytes_per_token
    assert fp8.kv_bytes_per_token_for(2) * 2 == auto.kv_bytes_per_token_for(2)
    shape = (1, 1, 1, 30000, 30000)  # one decode over a long context: the cache's bytes weigh
    assert fp8.cost.step_time(*shape) < auto.cost.step_time(*shape)
    assert fp8.settings_for("decode").num_blocks > 1.9 * auto.settings_for("decode").num_blocks


def test_a_calibration_refuses_the_flag_naming_it(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"cost_model": COST.to_dict(), "engine": {"kv_bytes_per_token": 4096}}))
    args = build_parser().parse_args(["plan", "--calibration", str(path), "--num-blocks", "512",
                                      "--kv-cache-dtype", "fp8"])
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        build_config(args)
    assert build_parser().parse_args(["calibrate", "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
