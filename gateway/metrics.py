"""Prometheus metrics of the serving system, as seen from the gateway.

Every ``GatewayMetrics`` owns its ``CollectorRegistry`` (no global default registry), so tests and
several gateways in one process never collide.  Names follow vLLM/Dynamo practice under the
``pdserve_`` namespace; counters get ``_total`` appended by prometheus_client.

    latency     pdserve_time_to_first_token_seconds, pdserve_inter_token_latency_seconds,
                pdserve_e2e_request_latency_seconds                       (histograms, by model)
    requests    pdserve_requests_total{model,endpoint,status}, pdserve_requests_in_flight,
                pdserve_client_write_timeouts_total, pdserve_key_limited_total,
                pdserve_connections_refused_total,
                pdserve_prompt_tokens_total, pdserve_generation_tokens_total
    prefix hit  pdserve_prefix_cache_hit_tokens_total / pdserve_prompt_tokens_total = hit rate
    routing     pdserve_prefill_skipped_total{reason}, pdserve_redis_unavailable_total,
                pdserve_responses_store_failures_total  (the Responses API's stored responses),
                pdserve_upstream_timeouts_total{phase}, pdserve_decode_busy_total{worker_id},
                pdserve_requests_queued,
                pdserve_migrations_total{cause}, pdserve_migrated_tokens_total  (streams moved, tokens replayed)
                pdserve_migration_gap_seconds  (a move's last token to the next one, from the new worker)
                pdserve_migration_precopies_total{outcome}, pdserve_migration_held_tokens_total (pre-copies)
                pdserve_registry_rejected_entries_total{reason}  (entries ignored: signature, address, ...)
    workers     pdserve_num_requests_waiting / _running, pdserve_kv_cache_usage_ratio,
                pdserve_num_waiting_prefill_tokens            (gauges, by worker_id and role),
                pdserve_workers{role,state}
    engine/KV   pdserve_kv_transfer_bytes_total, pdserve_kv_transfer_seconds,
                pdserve_kv_transfer_failures_total{reason}, pdserve_preemptions_total{worker_id}

Per API key (``render_per_key``, served at ``/admin/metrics`` to the admin token only: a key's id
tells who calls and how much, so it is not on the public ``/metrics``):

    per key     pdserve_key_limited_by_key_total{key_id}
"""
from __future__ import annotations

from typing import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from common.cluster.registry import ROLES, STATES, WorkerInfo

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0, 600.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ModelMetrics:
    """One model's children of the per-model metrics, looked up once (``.labels()`` hashes its
    arguments and takes a lock: too much to do per token)."""

    def __init__(self, metrics: "GatewayMetrics", model: str) -> None:
        self.time_to_first_token = metrics.time_to_first_token.labels(model)
        self.inter_token_latency = metrics.inter_token_latency.labels(model)
        self.e2e_request_latency = metrics.e2e_request_latency.labels(model)
        self.prompt_tokens = metrics.prompt_tokens.labels(model)
        self.generation_tokens = metrics.generation_tokens.labels(model)
        self.prefix_cache_hit_tokens = metrics.prefix_cache_hit_tokens.labels(model)


class GatewayMetrics:
    """The metric objects; the gateway updates them, ``render()`` serves ``/metrics``."""

    def __init__(self, registry: CollectorRegistry | None = None, *, namespace: str = "pdserve") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        kw = {"namespace": namespace, "registry": self.registry}

        self.time_to_first_token = Histogram(
            "time_to_first_token_seconds", "Request arrival to first token sent.", ["model"],
            buckets=TTFT_BUCKETS, **kw)
        self.inter_token_latency = Histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens of a request.",
            ["model"], buckets=ITL_BUCKETS, **kw)
        self.e2e_request_latency = Histogram(
            "e2e_request_latency_seconds", "Request arrival to last byte sent.", ["model"],
            buckets=E2E_BUCKETS, **kw)

        self.requests = Counter(
            "requests", "Finished requests by outcome: the HTTP status code, or 'stream_error' for a "
            "stream that ended with an error event.", ["model", "endpoint", "status"], **kw)
        self.requests_in_flight = Gauge("requests_in_flight", "Requests accepted and not finished.", **kw)
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens of accepted requests.", ["model"], **kw)
        self.generation_tokens = Counter("generation_tokens", "Tokens generated.", ["model"], **kw)
        self.prefix_cache_hit_tokens = Counter(
            "prefix_cache_hit_tokens", "Prompt tokens served from a worker's prefix cache "
            "(hit rate = this / prompt_tokens).", ["model"], **kw)

        self.prefill_skipped = Counter(
            "prefill_skipped", "Requests sent straight to the decode worker, by reason.", ["reason"], **kw)
        self.client_write_timeouts = Counter(
            "client_write_timeouts", "Connections (streams or not) cut off because the client took no data for "
            "the write timeout.", **kw)
        self.key_limited = Counter(
            "key_limited", "Requests refused (429) because their API key had its limit in flight or its "
            "share of the wait queue (per key: /admin/metrics).", **kw)
        self.per_key_registry = CollectorRegistry()
        self.key_limited_by_key = Counter(
            "key_limited_by_key", "Requests refused (429) because their API key had its limit in flight or its "
            "share of the wait queue, by key.",
            ["key_id"], namespace=namespace, registry=self.per_key_registry)
        self.connections_refused = Counter(
            "connections_refused", "Client connections refused (503) at the connection cap.", **kw)
        self.decode_busy = Counter(
            "decode_busy", "Times a decode worker answered busy (it could not reserve KV blocks).", ["worker_id"],
            **kw)
        self.requests_queued = Gauge(
            "requests_queued", "Requests holding a place in line for a decode worker with room (bounded queue).",
            **kw)
        self.upstream_timeouts = Counter(
            "upstream_timeouts", "Waits on a decode worker that ran out, by phase (response: no answer; "
            "first_token / idle: no frame; left: its worker gone from the registry and the stream silent, cut to "
            "move on).", ["phase"], **kw)
        self.redis_unavailable = Counter(
            "redis_unavailable", "Redis calls that failed or timed out (routing fell back to load).", **kw)
        self.responses_store_failures = Counter(
            "responses_store_failures", "Calls of the Responses API's store that Redis failed or did not answer in "
            "time (a response then not stored, or a stored one not read: 503).", **kw)
        self.registry_rejected = Counter(
            "registry_rejected_entries", "Registry entries ignored on read, by reason: signature (unsigned, "
            "forged or another secret), version (an older writer), expired, clock (written in the reader's future), "
            "misplaced, address, unreadable.", ["reason"], **kw)

        worker = ["worker_id", "role"]
        self.num_requests_waiting = Gauge("num_requests_waiting", "Requests queued on a worker.", worker, **kw)
        self.num_requests_running = Gauge("num_requests_running", "Requests running on a worker.", worker, **kw)
        self.num_waiting_prefill_tokens = Gauge(
            "num_waiting_prefill_tokens", "Prompt tokens admitted on a worker, not yet computed.", worker, **kw)
        self.kv_cache_usage = Gauge("kv_cache_usage_ratio", "Fraction of a worker's KV blocks in use (0-1).",
                                    worker, **kw)
        self.workers = Gauge("workers", "Live workers in the registry.", ["role", "state"], **kw)

        self.kv_transfer_bytes = Counter("kv_transfer_bytes", "KV cache bytes shipped prefill -> decode.", **kw)
        self.kv_transfer_seconds = Histogram(
            "kv_transfer_seconds", "Time from the decode worker's reservation of a request's KV blocks until "
            "they are all in (the prompt's prefill included).", buckets=TRANSFER_BUCKETS, **kw)
        self.kv_transfer_failures = Counter("kv_transfer_failures", "Failed KV transfers.", ["reason"], **kw)
        self.preemptions = Counter("preemptions", "Requests preempted for recompute.", ["worker_id"], **kw)
        self.migrations = Counter(
            "migrations", "Streams moved to another decode worker mid-stream (counted once that worker continues "
            "them), by cause: worker_lost (it died or stopped answering), drain (it handed the stream over).",
            ["cause"], **kw)
        self.migrated_tokens = Counter(
            "migrated_tokens", "Output tokens replayed to the decode worker a stream moved to.", **kw)
        self.migration_gap = Histogram(
            "migration_gap_seconds", "From a moved stream's last token at the worker it left to its next token "
            "from the worker it moved to.", buckets=TRANSFER_BUCKETS, **kw)
        self.precopies = Counter(
            "migration_precopies", "KV of streams about to be handed over, copied to the worker they will move "
            "to while they still decode, by outcome: ok, failed.", ["outcome"], **kw)
        self.migration_held_tokens = Counter(
            "migration_held_tokens", "Tokens of moved streams whose KV the worker they moved to already held "
            "(pre-copied): what the hand-over did not have to ship.", **kw)

        self._worker_labels: set[tuple[str, str]] = set()
        self._models: dict[str, ModelMetrics] = {}

    def model(self, model: str) -> ModelMetrics:
        """The per-model children for ``model`` (created on first use, then cached)."""
        children = self._models.get(model)
        if children is None:
            children = self._models[model] = ModelMetrics(self, model)
        return children

    def observe_workers(self, workers: Iterable[WorkerInfo]) -> None:
        """Set the per-worker gauges from a registry listing; workers no longer listed are dropped."""
        per_worker = (self.num_requests_waiting, self.num_requests_running,
                      self.num_waiting_prefill_tokens, self.kv_cache_usage)
        seen: set[tuple[str, str]] = set()
        counts = {(role, state): 0 for role in ROLES for state in STATES}
        for w in workers:
            labels = (w.worker_id, w.role)
            seen.add(labels)
            counts[(w.role, w.state)] += 1
            self.num_requests_waiting.labels(*labels).set(w.load.num_waiting)
            self.num_requests_running.labels(*labels).set(w.load.num_running)
            self.num_waiting_prefill_tokens.labels(*labels).set(w.load.num_waiting_prefill_tokens)
            self.kv_cache_usage.labels(*labels).set(w.load.kv_usage)
        for labels in self._worker_labels - seen:
            for gauge in per_worker:
                gauge.remove(*labels)
        self._worker_labels = seen
        for (role, state), n in counts.items():
            self.workers.labels(role, state).set(n)

    def key_refused(self, key_id: str) -> None:
        """A request refused (429) at its API key's limit."""
        self.key_limited.inc()
        self.key_limited_by_key.labels(key_id).inc()

    def render(self) -> tuple[bytes, str]:
        """``(body, content_type)`` for a ``/metrics`` response in the Prometheus text format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def render_per_key(self) -> tuple[bytes, str]:
        """The per-API-key metrics (for ``/admin/metrics``), in the same format."""
        return generate_latest(self.per_key_registry), CONTENT_TYPE_LATEST
