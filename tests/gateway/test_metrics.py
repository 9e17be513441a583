"""Gateway metric definitions: names, private registries, per-worker gauges."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from common.cluster.registry import Capacity, KVAddress, Load, WorkerInfo
from gateway.metrics import GatewayMetrics


def worker(worker_id: str, role: str = "prefill", **load) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, state="active", model="m", http_address="http://x",
                      kv_address=KVAddress("tcp", "x", 1), capacity=Capacity(10, 16, 4), load=Load(**load))


def samples(m: GatewayMetrics) -> dict[tuple[str, tuple], float]:
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def test_names_and_values_render():
    m = GatewayMetrics()
    m.time_to_first_token.labels("m").observe(0.12)
    m.inter_token_latency.labels("m").observe(0.02)
    m.e2e_request_latency.labels("m").observe(1.5)
    m.requests.labels("m", "completions", "200").inc()
    m.prompt_tokens.labels("m").inc(100)
    m.prefix_cache_hit_tokens.labels("m").inc(64)
    m.kv_transfer_bytes.inc(4096)
    m.kv_transfer_seconds.observe(0.003)
    m.kv_transfer_failures.labels("peer_timeout").inc()
    m.preemptions.labels("d0").inc()
    m.redis_unavailable.inc()
    m.prefill_skipped.labels("short prompt").inc()
    s = samples(m)
    assert s[("pdserve_time_to_first_token_seconds_count", (("model", "m"),))] == 1
    assert s[("pdserve_inter_token_latency_seconds_sum", (("model", "m"),))] == 0.02
    assert s[("pdserve_e2e_request_latency_seconds_count", (("model", "m"),))] == 1
    assert s[("pdserve_requests_total", (("endpoint", "completions"), ("model", "m"), ("status", "200")))] == 1
    assert s[("pdserve_prefix_cache_hit_tokens_total", (("model", "m"),))] == 64
    assert s[("pdserve_prompt_tokens_total", (("model", "m"),))] == 100
    assert s[("pdserve_kv_transfer_bytes_total", ())] == 4096
    assert s[("pdserve_kv_transfer_seconds_count", ())] == 1
    assert s[("pdserve_kv_transfer_failures_total", (("reason", "peer_timeout"),))] == 1
    assert s[("pdserve_preemptions_total", (("worker_id", "d0"),))] == 1
    assert s[("pdserve_redis_unavailable_total", ())] == 1
    assert s[("pdserve_prefill_skipped_total", (("reason", "short prompt"),))] == 1


def test_each_instance_has_its_own_registry():
    a, b = GatewayMetrics(), GatewayMetrics()  # would raise "Duplicated timeseries" on a shared one
    a.redis_unavailable.inc()
    assert samples(a)[("pdserve_redis_unavailable_total", ())] == 1
    assert samples(b)[("pdserve_redis_unavailable_total", ())] == 0


def test_worker_gauges_follow_the_registry_listing():
    m = GatewayMetrics()
    m.observe_workers([worker("p0", num_waiting=3, kv_usage=0.5, num_waiting_prefill_tokens=900),
                       worker("d0", "decode", num_running=12)])
    s = samples(m)
    assert s[("pdserve_num_requests_waiting", (("role", "prefill"), ("worker_id", "p0")))] == 3
    assert s[("pdserve_kv_cache_usage_ratio", (("role", "prefill"), ("worker_id", "p0")))] == 0.5
    assert s[("pdserve_num_waiting_prefill_tokens", (("role", "prefill"), ("worker_id", "p0")))] == 900
    assert s[("pdserve_num_requests_running", (("role", "decode"), ("worker_id", "d0")))] == 12
    assert s[("pdserve_workers", (("role", "prefill"), ("state", "active")))] == 1

    m.observe_workers([worker("d0", "decode", num_running=2)])  # p0 went away
    s = samples(m)
    assert not any(labels and dict(labels).get("worker_id") == "p0" for _, labels in s)
    assert s[("pdserve_workers", (("role", "prefill"), ("state", "active")))] == 0
    assert s[("pdserve_num_requests_running", (("role", "decode"), ("worker_id", "d0")))] == 2
