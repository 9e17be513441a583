"""A worker's counters: exported as Prometheus text on /metrics and as JSON on /stats."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class WorkerMetrics:
    """Counters a worker keeps about its requests and KV transfers."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_worker_requests", "Requests finished, by kind and outcome",
                                ["kind", "outcome"], registry=r)
        self.prefill_computed_tokens = Counter(
            "pdserve_worker_prefill_computed_tokens", "Prompt tokens computed by /prefill (not cache hits)", registry=r)
        self.prefill_cached_tokens = Counter(
            "pdserve_worker_prefill_cached_tokens", "Prompt tokens of /prefill found in the prefix cache", registry=r)
        self.kv_sent_bytes = Counter("pdserve_worker_kv_sent_bytes", "KV bytes shipped to decode workers", registry=r)
        self.kv_received_bytes = Counter("pdserve_worker_kv_received_bytes", "KV bytes received", registry=r)
        self.kv_transfer_seconds = Histogram(
            "pdserve_worker_kv_transfer_seconds",
            "Time from reservation to complete KV, per request (the prompt's prefill included)", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.kv_transfer_failures = Counter("pdserve_worker_kv_transfer_failures", "Failed KV transfers", registry=r)
        self.prefill_fallbacks = Counter(
            "pdserve_worker_remote_prefill_fallbacks", "Remote prefills that failed and were computed locally", registry=r)
        self.streams_handed_over = Counter(
            "pdserve_worker_streams_handed_over", "Streams a drain handed over to the gateway to continue elsewhere",
            registry=r)
        self.streams_open = Gauge(
            "pdserve_worker_streams_open", "Streams that have sent a token and not ended (a drain or a crash moves them)",
            registry=r)
        self.moved_blocks = Counter(
            "pdserve_worker_moved_blocks", "KV blocks of handed-over streams shipped to the worker each moved to",
            registry=r)
        self.auth_refused = Counter(
            "pdserve_worker_auth_refused", "Requests refused before their handler ran, by reason: credentials "
            "(missing, malformed, stale or wrong, or a body that is not the signed one), version (an older caller), audience (signed for another worker), "
            "replay, replay_window (signed too long ago for the replay cache), too_large (the body)", ["reason"],
            registry=r)
        self.kv_transfers_settling = Gauge(
            "pdserve_worker_kv_transfers_settling",
            "Abandoned KV transfers whose reserved blocks wait for in-flight bytes before being freed", registry=r)
        self.kv_blocks_still_landing = Gauge(
            "pdserve_worker_kv_blocks_still_landing",
            "KV blocks of ended requests kept out of use: a payload whose sender froze mid-way may still write "
            "into them (UCX cannot stop it); freed when it ends", registry=r)
        self.preemptions = Gauge("pdserve_worker_preemptions", "Requests preempted since start", registry=r)
        self.kv_usage = Gauge("pdserve_worker_kv_usage", "Fraction of KV blocks in use", registry=r)
        self.num_running = Gauge("pdserve_worker_num_running", "Requests in the running batch", registry=r)
        self.num_waiting = Gauge("pdserve_worker_num_waiting", "Requests waiting for admission", registry=r)
        # Speculative decoding (the engine's counters, mirrored at each scrape).
        self.spec_draft_tokens = Gauge("pdserve_worker_spec_draft_tokens", "Draft tokens verified since start",
                                       registry=r)
        self.spec_accepted_tokens = Gauge("pdserve_worker_spec_accepted_tokens", "Draft tokens accepted since start",
                                          registry=r)
        self.spec_acceptance_rate = Gauge("pdserve_worker_spec_acceptance_rate",
                                          "Accepted draft tokens / draft tokens, since start", registry=r)
        self.spec_tokens_per_verification = Gauge(
            "pdserve_worker_spec_mean_tokens_per_verification",
            "Tokens a request produced per verification step (accepted drafts + 1), since start", registry=r)
        self.spec_verify_step_seconds = Gauge(
            "pdserve_worker_spec_verify_step_seconds", "Mean duration of steps that verified drafts", registry=r)
        self.decode_only_step_seconds = Gauge(
            "pdserve_worker_decode_only_step_seconds",
            "Mean duration of decode steps without drafts (what a verification is compared with)", registry=r)

        # Core turns (common.engine.core_turns), mirrored at each scrape where the worker takes them.
        self.core_turns = Gauge("pdserve_worker_core_turns", "Engine steps run in a turn on the shared cores",
                                registry=r)
        self.core_turns_missed = Gauge(
            "pdserve_worker_core_turns_missed",
            "Engine steps run without a turn (another worker held the cores past the wait limit)", registry=r)
        self.core_turn_wait_seconds = Gauge(
            "pdserve_worker_core_turn_wait_seconds", "Time engine steps waited for their turn, since start", registry=r)

    def observe_core_turns(self, turns) -> None:
        """``turns``: the engine thread's ``CoreTurns``."""
        self.core_turns.set(turns.turns)
        self.core_turns_missed.set(turns.missed)
        self.core_turn_wait_seconds.set(turns.waited_s)

    def observe_engine(self, stats: dict) -> None:
        self.preemptions.set(stats["num_preemptions"])
        self.kv_usage.set(stats["kv_usage"])
        self.num_running.set(stats["num_running"])
        self.num_waiting.set(stats["num_waiting"])
        self.spec_draft_tokens.set(stats["spec_draft_tokens_total"])
        self.spec_accepted_tokens.set(stats["spec_accepted_tokens_total"])
        self.spec_acceptance_rate.set(stats["spec_acceptance_rate"])
        self.spec_tokens_per_verification.set(stats["spec_mean_tokens_per_verification"])
        self.spec_verify_step_seconds.set(_mean(stats["spec_verify_step_seconds_total"], stats["spec_verify_steps_total"]))
        self.decode_only_step_seconds.set(_mean(stats["decode_only_step_seconds_total"], stats["decode_only_steps_total"]))

    def snapshot(self) -> dict[str, float]:
        return {
            "prefill_computed_tokens": self.prefill_computed_tokens._value.get(),
            "prefill_cached_tokens": self.prefill_cached_tokens._value.get(),
            "kv_sent_bytes": self.kv_sent_bytes._value.get(),
            "kv_received_bytes": self.kv_received_bytes._value.get(),
            "kv_transfer_failures": self.kv_transfer_failures._value.get(),
            "remote_prefill_fallbacks": self.prefill_fallbacks._value.get(),
            "kv_transfers_settling": self.kv_transfers_settling._value.get(),
            "kv_blocks_still_landing": self.kv_blocks_still_landing._value.get(),
            "streams_handed_over": self.streams_handed_over._value.get(),
            "moved_blocks": self.moved_blocks._value.get(),
            "streams_open": self.streams_open._value.get(),
        }

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _mean(total: float, count: float) -> float:
    return total / count if count else 0.0
