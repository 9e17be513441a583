"""The request verifier's replay cache as a state machine (hypothesis): random interleavings of time
passing, new requests signed at various delays, and replays of any earlier request, against a
small cache.  Whatever the sequence: no signature is accepted twice, nothing stale is accepted,
the cache stays within its bound, and a new request is refused only when at least ``capacity``
accepted requests were acceptable at least as long as it (the cache had to choose)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from common.cluster.auth import MAX_CLOCK_SKEW_S, AuthError, ClusterAuth
from common.cluster.nonce_cache import NonceCache

SECRET = "replay-cache-test-secret-0123456789"
T0 = 1_700_000_000

ops = st.lists(st.one_of(
    st.tuples(st.just("advance"), st.integers(0, 200)),
    st.tuples(st.just("new"), st.integers(-20, int(MAX_CLOCK_SKEW_S) + 50)),  # signed this many s ago
    st.tuples(st.just("replay"), st.integers(0, 10_000)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 6), script=ops)
def test_no_replay_is_ever_accepted_and_the_cache_stays_bounded(capacity, script):
    now = [float(T0 - 3600)]  # the worker started an hour before the script begins
    auth = ClusterAuth(SECRET)
    verifier = auth.request_verifier("d0", clock=lambda: now[0], max_nonces=capacity)
    now[0] = float(T0)
    sent: list[tuple[dict, int]] = []  # every request signed so far, with its signing time
    accepted: dict[str, int] = {}  # nonce -> signing time, of accepted requests
    for op, arg in script:
        if op == "advance":
            now[0] += arg
            continue
        if op == "new":
            stamp = int(now[0]) - arg
            headers = auth.sign_request("POST", "/abort", b"{}", audience="d0", now=stamp)
            sent.append((headers, stamp))
        elif not sent:
            continue
        else:
            headers, stamp = sent[arg % len(sent)]
        nonce = headers["X-PD-Nonce"]
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


def test_capacity_must_be_positive():
    import pytest

    with pytest.raises(ValueError, match="capacity"):
        NonceCache(0)
