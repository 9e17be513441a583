"""Routing policies on plain WorkerInfo data (no Redis)."""
from __future__ import annotations

import random

import pytest

from common.cluster.registry import Capacity, KVAddress, Load, WorkerInfo
from gateway.routing import NoWorkerAvailable, Router, RoutingConfig, decode_load

BS = 16


def w(worker_id: str, role: str = "prefill", state: str = "active", *, q: int = 0, running: int = 0,
      waiting: int = 0, kv: float = 0.0, max_num_seqs: int = 64) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id, role=role, state=state, model="m", http_address=f"http://{worker_id}:8000",
        kv_address=KVAddress("tcp", worker_id, 9000),
        capacity=Capacity(num_kv_blocks=1000, block_size=BS, max_num_seqs=max_num_seqs),
        load=Load(num_waiting=waiting, num_running=running, kv_usage=kv, num_waiting_prefill_tokens=q),
    )


def router(policy: str = "prefix_aware", **kw) -> Router:
    return Router(RoutingConfig(policy=policy, skip_prefill_below_tokens=kw.pop("skip", 0), **kw))


DECODE = [w("d0", "decode")]


def test_round_robin_rotates_both_sides_and_skips_inactive():
    r = router("round_robin")
    pool = [w("p1"), w("p0"), w("p2", state="draining"), w("p3", state="starting"),
            w("d1", "decode"), w("d0", "decode"), w("d2", "decode", state="idle")]
    routes = [r.route(pool, 1000) for _ in range(4)]
    assert [x.prefill.worker_id for x in routes] == ["p0", "p1", "p0", "p1"]
    assert [x.decode.worker_id for x in routes] == ["d0", "d1", "d0", "d1"]


def test_least_load_prefers_short_prefill_queue_then_fewer_requests_then_id():
    r = router("least_load")
    pool = DECODE + [w("p0", q=500), w("p1", q=100, running=3), w("p2", q=100, running=1), w("p3", q=100, running=1)]
    assert r.route(pool, 1000, {"p0": 60}).prefill.worker_id == "p2"


def test_prefix_aware_prefers_cached_prefix_when_loads_are_equal():
    r = router()
    pool = DECODE + [w("p0"), w("p1"), w("p2")]
    route = r.route(pool, 1000, {"p0": 2, "p1": 10, "p2": 0})
    assert route.prefill.worker_id == "p1"
    assert route.prefill_matched_tokens == 160 and route.reason == "prefix_aware"


def test_prefix_aware_trades_match_against_queue():
    # p1 caches 320 more tokens but has 400 more tokens queued: with alpha=1 p0 finishes first.
    pool = DECODE + [w("p0", q=100), w("p1", q=500)]
    matches = {"p0": 0, "p1": 20}
    assert router().route(pool, 1000, matches).prefill.worker_id == "p0"
    # Chasing the cache harder (alpha=0.5) flips it: 320 - 250 > 0 - 50.
    assert router(alpha=0.5).route(pool, 1000, matches).prefill.worker_id == "p1"
    # Matches count only up to the prompt length.
    assert router().route(DECODE + [w("p1")], 100, {"p1": 1000}).prefill_matched_tokens == 100


def test_prefix_aware_caps_imbalance_so_a_hot_worker_is_not_buried():
    pool = DECODE + [w("hot", q=5000), w("cold", q=0)]
    matches = {"hot": 1000}  # 16000 cached tokens would beat any queue with alpha=1
    assert router(max_imbalance_tokens=8192).route(pool, 20000, matches).prefill.worker_id == "hot"
    assert router(max_imbalance_tokens=4096).route(pool, 20000, matches).prefill.worker_id == "cold"


def test_prefix_aware_without_index_falls_back_to_load():
    pool = DECODE + [w("p0", q=300), w("p1", q=200), w("p2", q=200)]
    assert router().route(pool, 1000, {}).prefill.worker_id in ("p1", "p2")  # the least loaded
    assert router().route(pool, 1000, None).prefill.worker_id in ("p1", "p2")


def test_prefix_aware_never_exceeds_the_imbalance_cap():
    rng = random.Random(0)
    cap = 1000
    r = router(max_imbalance_tokens=cap, alpha=0.1)
    for _ in range(300):
        pool = DECODE + [w(f"p{i}", q=rng.randrange(0, 5000)) for i in range(rng.randrange(1, 6))]
        matches = {x.worker_id: rng.randrange(0, 400) for x in pool}
        chosen = r.route(pool, 4096, matches).prefill
        assert chosen.load.num_waiting_prefill_tokens <= min(
            x.load.num_waiting_prefill_tokens for x in pool if x.role == "prefill") + cap


def test_decode_worker_chosen_by_scarcer_of_memory_and_slots():
    a = w("d0", "decode", kv=0.7, running=2)            # load 0.7 (memory)
    b = w("d1", "decode", kv=0.1, running=40, waiting=8)  # load 0.75 (slots)
    c = w("d2", "decode", kv=0.5, running=10)           # load 0.5
    assert decode_load(b) == pytest.approx(0.75)
    for policy in ("least_load", "prefix_aware"):
        assert router(policy).route([a, b, c, w("p0")], 1000).decode.worker_id == "d2"


def test_skip_prefill_for_short_prompts_and_prompts_the_decode_worker_caches():
    r = router(skip=256)
    pool = [w("d0", "decode"), w("p0")]
    short = r.route(pool, 200)
    assert short.prefill is None and short.reason == "short prompt"
    # 1000-token prompt, decode worker caches 50 blocks = 800 tokens: 200 left < 256.
    cached = r.route(pool, 1000, {"d0": 50, "p0": 62})
    assert cached.prefill is None and cached.decode_matched_tokens == 800
    assert cached.reason == "decode worker caches most of the prompt"
    # 48 blocks = 768 tokens cached: 232 left, still skipped; 40 blocks: 360 left, prefilled.
    assert r.route(pool, 1000, {"d0": 48}).prefill is None
    full = r.route(pool, 1000, {"d0": 40, "p0": 10})
    assert full.prefill.worker_id == "p0" and (full.decode_matched_tokens, full.prefill_matched_tokens) == (640, 160)
    # Threshold 0 never skips on length.
    assert router(skip=0).route(pool, 1).prefill.worker_id == "p0"


def test_decode_computes_the_prompt_when_no_prefill_worker_or_colocated():
    r = router()
    no_prefill = r.route([w("d0", "decode"), w("p0", state="draining")], 1000)
    assert no_prefill.prefill is None and no_prefill.reason == "no active prefill worker"
    colocated = r.route([w("b0", "both")], 1000)
    assert colocated.decode.worker_id == "b0" and colocated.prefill is None
    assert colocated.reason == "prefill worker is the decode worker"
    # A "both" worker can serve as the prefill side for another decode worker.
    mixed = r.route([w("d0", "decode"), w("b0", "both", running=60)], 1000)
    assert (mixed.decode.worker_id, mixed.prefill.worker_id) == ("d0", "b0")


def test_no_decode_worker_is_an_explicit_error():
    with pytest.raises(NoWorkerAvailable, match="no active decode worker"):
        router().route([w("p0"), w("d0", "decode", state="draining")], 100)
    with pytest.raises(NoWorkerAvailable):
        router().route([], 100)


def test_bad_config_and_input_name_the_problem():
    with pytest.raises(ValueError, match="routing policy 'fastest'"):
        RoutingConfig(policy="fastest")
    with pytest.raises(ValueError, match="alpha"):
        RoutingConfig(alpha=float("nan"))
    with pytest.raises(ValueError, match="max_imbalance_tokens"):
        RoutingConfig(max_imbalance_tokens=-1)
    with pytest.raises(ValueError, match="skip_prefill_below_tokens"):
        RoutingConfig(skip_prefill_below_tokens=-5)
    with pytest.raises(ValueError, match="prompt_len"):
        router().route(DECODE, 0)


def test_prefix_aware_gives_an_uncached_prefix_a_stable_home_and_spreads_prefixes():
    pool = DECODE + [w("p0"), w("p1"), w("p2")]
    homes = {}
    for i in range(60):
        key = f"prefix-{i}".encode()
        chosen = {router().route(pool, 1000, {}, affinity_key=key).prefill.worker_id for _ in range(3)}
        assert len(chosen) == 1  # the same prefix always lands on the same worker
        homes[key] = chosen.pop()
    counts = {wid: list(homes.values()).count(wid) for wid in ("p0", "p1", "p2")}
    assert all(n >= 10 for n in counts.values()), counts  # and different prefixes spread out


def test_prefix_aware_counts_what_this_gateway_has_just_sent():
    pool = DECODE + [w("p0"), w("p1")]
    key = next(f"k{i}".encode() for i in range(100)
               if router().route(pool, 1000, {}, affinity_key=f"k{i}".encode()).prefill.worker_id == "p0")
    # p0 would be the home, but this gateway just sent it 5000 tokens its heartbeat does not show yet.
    routed = router().route(pool, 1000, {}, affinity_key=key, pending={"p0": 5000})
    assert routed.prefill.worker_id == "p1"


def test_a_burst_of_decodes_spreads_with_what_this_gateway_just_sent():
    # Both decode workers reported the same load at their last heartbeat.  Counting what was sent
    # since, a burst alternates between them instead of piling onto the first.
    pool = [w("d0", "decode"), w("d1", "decode"), w("p0")]
    for policy in ("least_load", "prefix_aware"):
        r = router(policy)
        pending: dict[str, tuple[int, int]] = {}
        for _ in range(8):
            chosen = r.route(pool, 100, pending_decode=pending).decode.worker_id
            requests, blocks = pending.get(chosen, (0, 0))
            pending[chosen] = (requests + 1, blocks + 100 // BS)
        assert pending == {"d0": (4, 24), "d1": (4, 24)}
    # Memory counts too: prompt blocks sent but not yet in kv_usage.
    assert decode_load(w("d0", "decode"), (1, 500)) == pytest.approx(0.5)
