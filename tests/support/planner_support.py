"""What the planner's tests share: a cheap CPU-like cost model, a simulation config around it, and a
synthetic workload."""
from __future__ import annotations

import dataclasses

from pdctl.planner.cost_model import LinearCostModel
from pdctl.planner.sim_config import EngineSettings, SimConfig
from pdctl.planner.traffic import LengthDist, Workload, synthetic

# A cheap CPU-like step: 3 ms + 40 us per token + 2 us per sequence + 0.1 us per context token.
COST = LinearCostModel((3e-3, 4e-5, 2e-6, 0.0, 0.0, 1e-7))


def config(**engine_changes) -> SimConfig:
    engine = EngineSettings(num_blocks=2048, block_size=16, max_num_batched_tokens=512, max_num_seqs=64,
                            max_model_len=4096)
    engine = dataclasses.replace(engine, **engine_changes)
    return SimConfig(cost=COST, engine=engine, kv_bytes_per_token=4096.0, slo_ttft_s=1.0, slo_tpot_s=0.05)


def workload(rate=4.0, duration=20.0, prompt="uniform:200:600", output="uniform:16:48", seed=1, **kw) -> Workload:
    return synthetic(rate, duration, LengthDist.parse(prompt), LengthDist.parse(output), seed=seed, **kw)
