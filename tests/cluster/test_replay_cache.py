"""The request verifier's replay cache as a state machine (hypothesis): random interleavings of time
passing, new requests signed at various delays, replays of any earlier request, and copies of any
earlier request with a body that is not the signed one (their nonce is taken, then given back),
against a small cache.  Whatever the sequence: no signature is accepted twice, nothing stale is
accepted, no wrong body is accepted, the cache stays within its bound, and a new request is
refused only when at least ``capacity`` accepted requests were acceptable at least as long as it
(the cache had to choose)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from common.cluster.auth import MAX_CLOCK_SKEW_S, AuthError, ClusterAuth
from common.cluster.nonce_cache import REPLAYED, TOO_OLD, NonceCache

SECRET = "replay-cache-test-secret-0123456789"
T0 = 1_700_000_000

ops = st.lists(st.one_of(
    st.tuples(st.just("advance"), st.integers(0, 200)),
    st.tuples(st.just("new"), st.integers(-20, int(MAX_CLOCK_SKEW_S) + 50)),  # signed this many s ago
    st.tuples(st.just("replay"), st.integers(0, 10_000)),
    st.tuples(st.just("wrong_body"), st.integers(0, 10_000)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 6), script=ops)
def test_no_replay_is_ever_accepted_and_the_cache_stays_bounded(capacity, script):
    now = [float(T0)]
    auth = ClusterAuth(SECRET)
    verifier = auth.request_verifier("d0", clock=lambda: now[0], max_nonces=capacity)
    sent: list[tuple[dict, int]] = []  # every request signed so far, with its signing time
    accepted: dict[str, int] = {}  # nonce -> signing time, of accepted requests
    for op, arg in script:
        if op == "advance":
            now[0] += arg
            continue
        if op == "new":
            stamp = int(now[0]) - arg
            headers = auth.sign_request("POST", "/abort", b"{}", audience=verifier.audience, now=stamp)
            sent.append((headers, stamp))
        elif not sent:
            continue
        else:
            headers, stamp = sent[arg % len(sent)]
        nonce = headers["X-PD-Nonce"]
        if op == "wrong_body":
            with pytest.raises(AuthError):
                verifier.verify_request("POST", "/abort", headers, b"[]")
            assert len(verifier.seen) <= capacity
            continue
        try:
            verifier.verify_request("POST", "/abort", headers, b"{}")
        except AuthError as exc:
            fresh = abs(now[0] - stamp) <= MAX_CLOCK_SKEW_S
            if op == "new" and fresh:
                # Refused although new and fresh: only because the cache was full of requests
                # acceptable at least as long.
                assert exc.reason == "replay_window", exc
                until = stamp + MAX_CLOCK_SKEW_S
                assert sum(1 for s in accepted.values() if s + MAX_CLOCK_SKEW_S >= until) >= capacity
        else:
            assert nonce not in accepted, "a signature was accepted twice"
            assert abs(now[0] - stamp) <= MAX_CLOCK_SKEW_S, "a stale request was accepted"
            accepted[nonce] = stamp
        assert len(verifier.seen) <= capacity


def test_a_nonce_given_back_leaves_the_refusal_of_evicted_ones_in_place():
    """Full, the cache forgets the nonce that expires first and refuses, from then on, whatever
    is acceptable no longer than it -- also once a nonce given back leaves the cache not full."""
    cache = NonceCache(2)
    assert cache.remember("a", 10, 0) is None and cache.remember("b", 20, 0) is None
    assert cache.remember("c", 30, 0) is None  # full: "a" is forgotten
    assert cache.evicted == 1 and cache.evicted_until == 10
    cache.release("c")  # its request was not served after all
    assert len(cache) == 1
    assert cache.refusal("a", 10, 1) == TOO_OLD  # the replay of "a" still cannot pass
    assert cache.refusal("b", 20, 1) == REPLAYED and cache.refusal("c", 30, 1) is None
    assert cache.refusal("a", 10, 11) == TOO_OLD  # (stale for the verifier by then anyway)


def test_giving_nonces_back_keeps_the_cache_small():
    cache = NonceCache(4)
    for i in range(10_000):
        assert cache.remember("n", 100 + i % 3, 0) is None
        cache.release("n")
    assert len(cache) == 0 and len(cache._heap) <= 64 + 1


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        NonceCache(0)
