"""The cluster-secret primitives every internal channel uses (common.cluster.auth), and the request
verifier of cluster auth v3 on a clock the tests hold (no sleeping, no races)."""
from __future__ import annotations

import pytest

from common.cluster.auth import (
    AUDIENCE_HEADER, BODY_HEADER, MAX_CLOCK_SKEW_S, NONCE_HEADER, SIGNATURE_HEADER, TIME_HEADER, VERSION_HEADER,
    SECRET_ENV, AuthError, ClusterAuth, audience_of, generate_secret, is_loopback, read_secret, secret_problem,
)

SECRET = "k3Jv8s0Lw2qZrTn5YpQm7bVx"
T0 = 1_700_000_000
RUN = "0123456789abcdef" * 2  # the instance id of the worker runs these tests verify for
D0 = audience_of("d0", RUN)


class Clock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def verifier(worker_id: str = "d0", clock: Clock | None = None, max_nonces: int = 1024, secret: str = SECRET,
             instance: str | None = RUN):
    """The verifier of a worker's run ``instance`` (a fresh one when None)."""
    return ClusterAuth(secret).request_verifier(worker_id, instance, clock=clock or Clock(), max_nonces=max_nonces)


def signed(method="POST", path="/generate", body=b'{"a": 1}', audience=D0, now=T0, secret=SECRET) -> dict:
    return ClusterAuth(secret).sign_request(method, path, body, audience=audience, now=now)


def refusal(v, method, path, headers, body) -> AuthError:
    with pytest.raises(AuthError) as err:
        v.verify_request(method, path, headers, body)
    return err.value


def test_a_signed_request_verifies_once_and_any_change_is_refused():
    v = verifier()
    headers = signed()
    for method, path, body in [("GET", "/generate", b'{"a": 1}'), ("POST", "/prefill", b'{"a": 1}'),
                               ("POST", "/generate", b'{"a": 2}'), ("POST", "/generate?x=1", b'{"a": 1}')]:
        assert refusal(v, method, path, headers, body).reason == "credentials"
    v.verify_request("POST", "/generate", headers, b'{"a": 1}')
    assert set(headers) == {VERSION_HEADER, TIME_HEADER, NONCE_HEADER, AUDIENCE_HEADER, BODY_HEADER, SIGNATURE_HEADER}
    assert headers[VERSION_HEADER] == "3" and headers[AUDIENCE_HEADER] == f"d0/{RUN}"


def test_a_replayed_request_is_refused_until_it_is_stale():
    clock = Clock()
    v = verifier(clock=clock)
    headers = signed()
    v.verify_request("POST", "/generate", headers, b'{"a": 1}')
    for advance in (0, 1, MAX_CLOCK_SKEW_S):  # the nonce is remembered as long as the time is acceptable
        clock.now = T0 + advance
        err = refusal(v, "POST", "/generate", headers, b'{"a": 1}')
        assert err.reason == "replay" and "replayed" in str(err)
    clock.now = T0 + MAX_CLOCK_SKEW_S + 1  # then forgotten, because the request is stale anyway
    assert "stale" in str(refusal(v, "POST", "/generate", headers, b'{"a": 1}'))
    v.verify_request("POST", "/generate", signed(now=clock.now), b'{"a": 1}')
    assert len(v.seen) == 1  # only the new nonce: the stale one's is gone
    # Another signature of the same call has its own nonce.
    v.verify_request("POST", "/generate", signed(now=clock.now), b'{"a": 1}')


def test_a_request_for_another_worker_is_refused_even_with_the_audience_header_rewritten():
    v = verifier("d1-private")
    headers = signed(audience=D0)
    err = refusal(v, "POST", "/generate", headers, b'{"a": 1}')
    # The refusal names neither audience: a stranger learns nothing to build credentials with.
    assert err.reason == "audience" and str(err) == (
        "cluster credentials for another worker, or for an earlier run of this one (sign for the audience of its "
        "current registry entry)")
    assert "d1-private" not in str(err) and "d0" not in str(err) and RUN not in str(err)
    # The MAC is computed with the verifier's own audience: rewriting the header does not help.
    err = refusal(v, "POST", "/generate", {**headers, AUDIENCE_HEADER: v.audience}, b'{"a": 1}')
    assert err.reason == "credentials" and "wrong" in str(err)
    for bad in ("http://10.0.0.1:1", "d0", f"d0/{RUN.upper()}", f"d0/{RUN[:-1]}"):
        with pytest.raises(ValueError, match="WORKER_ID/INSTANCE"):
            ClusterAuth(SECRET).sign_request("POST", "/generate", audience=bad)


def test_a_request_for_an_earlier_run_of_the_worker_is_refused_whatever_its_time():
    """Issue 27's security review: a request stamped up to the skew allowance in the worker's
    future (a caller's clock ahead), accepted once, was accepted again by the same worker
    restarted a few seconds later -- its replay cache was empty and the stamp after its start.
    Each run has its own instance id in the audience, so nothing signed for one run passes another."""
    clock = Clock(T0)
    auth = ClusterAuth(SECRET)
    first_run = auth.request_verifier("d0", clock=clock)
    for ahead in (100, MAX_CLOCK_SKEW_S):
        headers = auth.sign_request("POST", "/admin/drain", b"{}", audience=first_run.audience, now=T0 + ahead)
        first_run.verify_request("POST", "/admin/drain", headers, b"{}")
        for restarted_after in (1, 5, ahead - 1):
            clock.now = T0 + restarted_after
            restarted = auth.request_verifier("d0", clock=clock)  # same worker id, empty replay cache
            assert restarted.instance != first_run.instance
            assert refusal(restarted, "POST", "/admin/drain", headers, b"{}").reason == "audience"
            # What the caller signs for the new run (from its new registry entry) is accepted.
            restarted.verify_request("POST", "/admin/drain", auth.sign_request(
                "POST", "/admin/drain", b"{}", audience=restarted.audience, now=clock.now), b"{}")
        clock.now = T0


def test_another_secret_missing_malformed_or_stale_credentials_are_refused():
    v = verifier()
    assert "wrong" in str(refusal(v, "POST", "/abort", signed(path="/abort", secret="another-secret-of-enough-length"),
                                  b'{"a": 1}'))
    assert str(refusal(v, "POST", "/abort", {}, b"")) == "missing cluster credentials"
    good = signed()
    for name in (TIME_HEADER, NONCE_HEADER, AUDIENCE_HEADER, BODY_HEADER, SIGNATURE_HEADER):
        headers = {k: val for k, val in good.items() if k != name}
        assert name in str(refusal(v, "POST", "/generate", headers, b'{"a": 1}'))
    for name, bad in [(TIME_HEADER, "abc"), (TIME_HEADER, "\u0661\u0667" + "0" * 8), (TIME_HEADER, "1" * 13),
                      (TIME_HEADER, "\u00b2" * 10), (TIME_HEADER, "+1700000000"), (NONCE_HEADER, "0" * 31),
                      (NONCE_HEADER, "A" * 32), (SIGNATURE_HEADER, good[SIGNATURE_HEADER].upper()),
                      (SIGNATURE_HEADER, "\u00e9" * 64), (SIGNATURE_HEADER, "\udcff" * 64),
                      (AUDIENCE_HEADER, "d0 "), (AUDIENCE_HEADER, "d\u0660"), (AUDIENCE_HEADER, "d0"),
                      (AUDIENCE_HEADER, f"d0/{RUN}/"), (BODY_HEADER, "8"), (BODY_HEADER, "08:" + "0" * 64),
                      (BODY_HEADER, "\u0668:" + "0" * 64), (BODY_HEADER, "8:" + "A" * 64),
                      (BODY_HEADER, "-8:" + "0" * 64)]:
        err = refusal(v, "POST", "/generate", {**good, name: bad}, b'{"a": 1}')
        assert err.reason == "credentials" and f"malformed cluster credentials ({name})" in str(err), (name, bad)
    for skew in (-MAX_CLOCK_SKEW_S - 1, MAX_CLOCK_SKEW_S + 1):
        assert str(refusal(v, "POST", "/generate", signed(now=T0 + skew), b'{"a": 1}')) == (
            f"stale cluster credentials (signed more than {MAX_CLOCK_SKEW_S:.0f} s away from this worker's clock)")


def test_another_scheme_version_is_refused_with_a_message_saying_so():
    v = verifier()
    good = signed()
    v1 = {TIME_HEADER: good[TIME_HEADER], SIGNATURE_HEADER: good[SIGNATURE_HEADER]}  # what a v1 caller sends
    err = refusal(v, "POST", "/generate", v1, b'{"a": 1}')
    assert err.reason == "version" and "v1" in str(err) and "older pdserve" in str(err)
    assert refusal(v, "POST", "/generate", {SIGNATURE_HEADER: good[SIGNATURE_HEADER]}, b"").reason == "version"
    err = refusal(v, "POST", "/generate", {**good, VERSION_HEADER: "2"}, b'{"a": 1}')
    assert err.reason == "version" and "version 2" in str(err)
    err = refusal(v, "POST", "/generate", {**good, VERSION_HEADER: "3\u00e9"}, b'{"a": 1}')
    assert err.reason == "version" and "\u00e9" not in str(err)  # a stranger's bytes are not echoed


def test_the_replay_cache_is_bounded_and_never_accepts_a_replay_when_full():
    """Full: the nonce that expires first is evicted and requests acceptable only until its expiry
    are refused from then on (they might be its replay); fresh requests still pass."""
    clock = Clock()
    v = verifier(clock=clock, max_nonces=3)
    old = [signed(now=T0 - 30 + i) for i in range(3)]  # signed 30, 29, 28 s ago (in flight that long)
    for headers in old:
        v.verify_request("POST", "/generate", headers, b'{"a": 1}')
    fresh = signed(now=T0)
    v.verify_request("POST", "/generate", fresh, b'{"a": 1}')  # evicts the oldest nonce
    assert len(v.seen) == 3 and v.seen.evicted == 1
    err = refusal(v, "POST", "/generate", old[0], b'{"a": 1}')  # its replay: not accepted, though forgotten
    assert err.reason == "replay_window" and "too old" in str(err)
    late = signed(now=T0 - 30)  # a new request as old as the evicted one: refused too, nothing evicted
    assert refusal(v, "POST", "/generate", late, b'{"a": 1}').reason == "replay_window"
    assert v.seen.evicted == 1
    for headers in (old[1], old[2], fresh):
        assert refusal(v, "POST", "/generate", headers, b'{"a": 1}').reason == "replay"
    v.verify_request("POST", "/generate", signed(now=T0), b'{"a": 1}')  # fresh ones keep passing
    assert len(v.seen) == 3


def test_disabled_auth_signs_nothing_and_accepts_everything():
    auth = ClusterAuth.disabled()
    assert auth.sign_request("POST", "/generate", audience=D0) == {}
    auth.request_verifier("d0").verify_request("POST", "/generate", {}, b"anything")
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


def test_a_generated_secret_never_reads_as_a_flag():
    """token_urlsafe starts one secret in 64 with "-": given after its flag on a command line, it
    was taken for another flag ("expected one argument"; test_gateway_config failed so, now and then)."""
    drawn = [generate_secret() for _ in range(4000)]
    assert not any(s.startswith("-") for s in drawn)
    assert len(set(drawn)) == len(drawn) and all(len(s) == 43 for s in drawn)


def test_the_v3_signature_is_the_documented_one():
    """A known-answer check of the wire format (the module docstring), computed independently:
    a caller written from the documentation interoperates."""
    import hashlib
    import hmac

    audience = audience_of("p-7", RUN)
    headers = signed(method="post", path="/admin/steps?since=1.5", body=b"xyz", audience=audience, now=T0 + 0.9)
    key = hmac.new(SECRET.encode(), b"pdserve/http/3", hashlib.sha256).digest()
    body = f"3:{hashlib.sha256(b'xyz').hexdigest()}".encode()
    parts = [b"POST", b"/admin/steps?since=1.5", str(T0).encode(), headers[NONCE_HEADER].encode(),
             f"p-7/{RUN}".encode(), body]
    message = b"".join(len(p).to_bytes(4, "big") + p for p in parts)
    assert headers[TIME_HEADER] == str(T0) and headers[BODY_HEADER] == body.decode()
    assert headers[SIGNATURE_HEADER] == hmac.new(key, message, hashlib.sha256).hexdigest()
    assert len(headers[NONCE_HEADER]) == 32 and headers[NONCE_HEADER] != signed()[NONCE_HEADER]


def test_a_credential_header_given_twice_is_refused():
    from multidict import CIMultiDict

    v = verifier()
    good = signed()
    for name in (VERSION_HEADER, TIME_HEADER, NONCE_HEADER, AUDIENCE_HEADER, BODY_HEADER, SIGNATURE_HEADER):
        headers = CIMultiDict(good)
        headers.add(name, good[name])
        err = refusal(v, "POST", "/generate", headers, b'{"a": 1}')
        assert err.reason == "credentials" and f"{name} given 2 times" in str(err)
    v.verify_request("POST", "/generate", CIMultiDict(good), b'{"a": 1}')  # once each: accepted


def test_headers_are_verified_whole_before_the_body_and_a_wrong_body_uses_up_nothing():
    """Everything the MAC covers is in the headers: a wrong signature is refused by
    ``verify_headers`` alone (the worker reads no body for it).  The body is then checked against
    the signed length and SHA-256; one that is not the signed one is refused and gives the nonce
    back, so the genuine request still goes through once."""
    v = verifier()
    stranger = signed(secret="a-stranger-secret-of-enough-length")
    with pytest.raises(AuthError) as err:
        v.verify_headers("POST", "/generate", stranger)
    assert err.value.reason == "credentials" and "wrong" in str(err.value)
    headers = signed(body=b'{"a": 1}')
    for body in (b'{"a": 2}', b'{"a": 1} ', b'{"a": 1', b""):
        creds = v.verify_headers("POST", "/generate", headers)
        assert (creds.body_length, len(v.seen)) == (8, 1)
        with pytest.raises(AuthError, match="not the one"):
            v.verify_body(creds, body)
        v.release(creds)
        assert len(v.seen) == 0
        assert refusal(v, "POST", "/generate", headers, body).reason == "credentials"  # both stages at once
        assert len(v.seen) == 0
    v.verify_request("POST", "/generate", headers, b'{"a": 1}')
    assert refusal(v, "POST", "/generate", headers, b'{"a": 1}').reason == "replay"


def test_two_copies_in_flight_at_once_get_one_body_read():
    """The nonce is taken when the headers verify, before any body is read: a second copy
    arriving meanwhile is refused at once (no body of it read); if the first is not served after
    all, the nonce is given back and a later copy may go through."""
    v = verifier()
    headers = signed()
    first = v.verify_headers("POST", "/generate", headers)
    with pytest.raises(AuthError) as err:
        v.verify_headers("POST", "/generate", headers)
    assert err.value.reason == "replay"
    v.release(first)  # e.g. its body never arrived
    again = v.verify_headers("POST", "/generate", headers)
    v.verify_body(again, b'{"a": 1}')  # served this time
    with pytest.raises(AuthError) as err:
        v.verify_headers("POST", "/generate", headers)
    assert err.value.reason == "replay"


def test_the_secret_comes_from_its_file_or_else_the_environment(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(f"  {SECRET}\n")
    assert read_secret(str(secret_file), env={SECRET_ENV: "from-the-environment"}) == SECRET  # the file wins
    assert read_secret(None, env={SECRET_ENV: SECRET}) == SECRET
    assert read_secret(None, env={SECRET_ENV: ""}) is None and read_secret(None, env={}) is None
    with pytest.raises(AuthError) as err:
        read_secret(str(tmp_path / "absent"), env={SECRET_ENV: SECRET})
    assert str(err.value) == f"cannot read the cluster secret file {tmp_path / 'absent'}: No such file or directory"
    # from_env reads the same variable: its signatures are the secret's.
    headers = ClusterAuth.from_env({SECRET_ENV: SECRET}).sign_request("POST", "/generate", b"{}", audience=D0, now=T0)
    verifier().verify_request("POST", "/generate", headers, b"{}")
    assert not ClusterAuth.from_env({SECRET_ENV: ""}).enabled
