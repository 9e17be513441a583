"""A worker's /metrics carries the engine's speculation counters: acceptance, tokens per
verification, and what a verification step costs next to a plain decode step."""
from prometheus_client.parser import text_string_to_metric_families

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from worker.metrics import WorkerMetrics


def test_speculation_counters_reach_metrics(served_checkpoint):
    engine = Engine(EngineConfig(model=str(served_checkpoint), num_blocks=64, block_size=4, speculative="ngram",
                                 ngram_min=1), load_tokenizer=False)
    prompt = [5, 6, 7, 8, 9] * 6  # (the batch gate may pause speculation: counters must add up either way)
    engine.generate([prompt], {"temperature": 0.0, "max_tokens": 30, "ignore_eos": True})
    stats = engine.stats()
    assert stats["spec_verifications_total"] > 0
    metrics = WorkerMetrics()
    metrics.observe_engine(stats)
    values = {s.name: s.value for family in text_string_to_metric_families(metrics.render().decode())
              for s in family.samples}
    assert values["pdserve_worker_spec_draft_tokens"] == stats["spec_draft_tokens_total"] > 0
    assert values["pdserve_worker_spec_accepted_tokens"] == stats["spec_accepted_tokens_total"]
    assert values["pdserve_worker_spec_acceptance_rate"] == stats["spec_acceptance_rate"]
    assert values["pdserve_worker_spec_mean_tokens_per_verification"] >= 1.0
    assert values["pdserve_worker_spec_verify_step_seconds"] == \
        stats["spec_verify_step_seconds_total"] / stats["spec_verify_steps_total"] > 0
    assert values["pdserve_worker_decode_only_step_seconds"] > 0
