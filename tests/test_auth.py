"""The cluster-secret primitives every internal channel uses (common.cluster.auth)."""
from __future__ import annotations

import pytest

from common.cluster.auth import (
    MAX_CLOCK_SKEW_S, SIGNATURE_HEADER, TIME_HEADER, AuthError, ClusterAuth, generate_secret, is_loopback,
    secret_problem,
)

SECRET = "k3Jv8s0Lw2qZrTn5YpQm7bVx"


def test_signed_request_verifies_and_any_change_is_refused():
    auth = ClusterAuth(SECRET)
    headers = auth.sign_request("POST", "/generate", b'{"a": 1}', now=1000)
    auth.verify_request("POST", "/generate", headers, b'{"a": 1}', now=1000)
    for method, path, body in [("GET", "/generate", b'{"a": 1}'), ("POST", "/prefill", b'{"a": 1}'),
                               ("POST", "/generate", b'{"a": 2}')]:
        with pytest.raises(AuthError, match="wrong"):
            auth.verify_request(method, path, headers, body, now=1000)


def test_another_secret_missing_or_stale_credentials_are_refused():
    auth = ClusterAuth(SECRET)
    forged = ClusterAuth("another-secret-of-enough-length").sign_request("POST", "/abort", b"x", now=50)
    with pytest.raises(AuthError, match="wrong"):
        auth.verify_request("POST", "/abort", forged, b"x", now=50)
    with pytest.raises(AuthError, match="missing"):
        auth.check_request_headers({})
    with pytest.raises(AuthError, match="malformed"):
        auth.check_request_headers({TIME_HEADER: "abc", SIGNATURE_HEADER: "00" * 32})
    old = auth.sign_request("POST", "/abort", b"x", now=50)
    with pytest.raises(AuthError, match="stale"):
        auth.verify_request("POST", "/abort", old, b"x", now=50 + MAX_CLOCK_SKEW_S + 1)


def test_disabled_auth_signs_nothing_and_accepts_everything():
    auth = ClusterAuth.disabled()
    assert auth.sign_request("POST", "/generate") == {}
    auth.verify_request("POST", "/generate", {}, b"anything")
    assert auth.sign_entry(b"entry") == "" and auth.verify_entry(b"entry", "")


def test_channel_keys_are_separate():
    auth = ClusterAuth(SECRET)
    entry_sig = auth.sign_entry(b"payload")
    assert auth.verify_entry(b"payload", entry_sig)
    assert not auth.verify_entry(b"payload2", entry_sig)
    assert not ClusterAuth("x" * 20).verify_entry(b"payload", entry_sig)
    assert auth.kv_proof(b"payload") != bytes.fromhex(entry_sig)
    assert auth.kv_proof_matches((b"a", b"bc"), auth.kv_proof(b"a", b"bc"))
    assert not auth.kv_proof_matches((b"ab", b"c"), auth.kv_proof(b"a", b"bc"))  # parts are length-prefixed


def test_secret_required_only_when_a_listener_leaves_loopback():
    ClusterAuth.disabled().require_secret(["127.0.0.1", "::1", "localhost"])
    with pytest.raises(AuthError, match="PDSERVE_CLUSTER_SECRET"):
        ClusterAuth.disabled().require_secret(["127.0.0.1", "0.0.0.0"])
    ClusterAuth(SECRET).require_secret(["0.0.0.0"])
    assert is_loopback("127.0.0.5") and not is_loopback("10.0.0.1") and not is_loopback("worker-3")


def test_weak_and_placeholder_secrets_are_named():
    assert secret_problem("") == "it is empty"
    assert "placeholder" in secret_problem("change-me-please-1234567")
    assert "shorter" in secret_problem("short")
    assert secret_problem(generate_secret()) is None
