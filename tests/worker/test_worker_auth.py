"""Every worker endpoint but /health refuses callers without the cluster secret, before reading the
body, and nothing happens: no request admitted, no block allocated, no abort, no drain, no role change.
A signed request works once, on the worker run it was signed for: replayed, sent to another
worker or to another run of the same one, it is refused (cluster auth v3: nonce, audience with the
run's instance, body digest in the signed headers).  The admin endpoints take signed calls only.

A real stack (1 prefill + 1 decode worker, real Redis, the gateway): the test holds the stack's
secret, so it can also show that the same calls, correctly signed, do take effect.  Requests that
must be refused go out as raw bytes on a socket, so no client library tidies their headers.
"""
from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from common.cluster.auth import MAX_CLOCK_SKEW_S, ClusterAuth, audience_of, new_instance_id
from common.cluster.messages import (
    MAX_FRAME_BYTES, AbortRequest, GenerateRequest, PrefillRequest, TokenFrame, decode, encode,
)
from common.engine.sampling_params import SamplingParams
from tests.support.cluster import ADMIN_TOKEN, http_json, running_cluster

pytestmark = pytest.mark.slow(seconds=11)  # a long file: scheduled by its length (tests/conftest.py)

PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def cluster(served_checkpoint, tmp_path_factory, redis_url):
    with running_cluster(served_checkpoint, tmp_path_factory.mktemp("workerauth"), redis_url, prefill=1, decode=1,
                         worker_args=["--num-blocks", "320", "--block-size", "4"]) as c:
        yield c


def call(url: str, method: str, body: bytes | None, headers: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def endpoints(cluster) -> list[tuple[str, str, str, bytes, dict]]:
    """(worker, method, path, a valid body, extra headers) for every endpoint a worker serves."""
    params = SamplingParams(max_tokens=4, temperature=0.0)
    generate = encode(GenerateRequest(request_id="forged-generate", prompt_token_ids=PROMPT, sampling_params=params))
    prefill = encode(PrefillRequest(request_id="forged-prefill", prompt_token_ids=PROMPT, sampling_params=params,
                                    decode_worker_id="d0", dst_block_ids=list(range(10)), num_skip_blocks=0,
                                    transfer_id="0" * 32))
    admin = {"Content-Type": "application/json"}
    return [
        ("d0", "POST", "/generate", generate, {}),
        ("p0", "POST", "/prefill", prefill, {}),
        ("d0", "POST", "/abort", encode(AbortRequest("forged-abort")), {}),
        ("d0", "GET", "/stats", b"", {}),
        ("d0", "GET", "/stats?check=1", b"", {}),
        ("p0", "GET", "/metrics", b"", {}),
        ("d0", "GET", "/admin/status", b"", admin),
        ("d0", "POST", "/admin/drain", b"{}", admin),
        ("p0", "POST", "/admin/role", b'{"role": "decode"}', admin),
    ]


def v1_signature(secret: str, method: str, path: str, body: bytes, now: float) -> dict[str, str]:
    """The headers a caller of cluster auth v1 (before nonces and audiences) signs, with the right secret."""
    key = hmac.new(secret.encode(), b"pdserve/http", hashlib.sha256).digest()
    stamp = str(int(now))
    message = b"\n".join([method.encode(), path.encode(), stamp.encode(), hashlib.sha256(body).digest()])
    return {"X-PD-Time": stamp, "X-PD-Signature": hmac.new(key, message, hashlib.sha256).hexdigest()}


def forgeries(secret: str, audiences: dict[str, str], worker: str, method: str, path: str,
              body: bytes) -> dict[str, tuple[str, bytes, dict]]:
    """Ways to call ``worker`` without valid credentials: (path sent, body sent, auth headers) by name."""
    right, wrong = ClusterAuth(secret), ClusterAuth("a-different-secret-of-enough-length")
    audience, other = audiences[worker], audiences[{"d0": "p0", "p0": "d0"}[worker]]
    if body:
        tampered = (path, body[:-1] + bytes([body[-1] ^ 1]), right.sign_request(method, path, body, audience=audience))
    else:  # nothing to tamper with in a GET body: the signature is for another path
        tampered = (path, body, right.sign_request(method, path + "x", body, audience=audience))
    return {
        "no credentials": (path, body, {}),
        "wrong secret": (path, body, wrong.sign_request(method, path, body, audience=audience)),
        "tampered": tampered,
        "for another worker": (path, body, right.sign_request(method, path, body, audience=other)),
        "for an earlier run": (path, body, right.sign_request(method, path, body,
                                                              audience=audience_of(worker, new_instance_id()))),
        "stale": (path, body, right.sign_request(method, path, body, audience=audience,
                                                 now=time.time() - MAX_CLOCK_SKEW_S - 60)),
        "malformed": (path, body, {"X-PD-Auth": "3", "X-PD-Time": "soon", "X-PD-Signature": "00"}),
        "auth v1": (path, body, v1_signature(secret, method, path, body, time.time())),
    }


def state(cluster) -> dict:
    """What a forged call could change, read with valid credentials."""
    out = {}
    for name in ("p0", "d0"):
        stats = cluster.worker_json(name, "/stats?check=1")
        assert stats["pool_ok"], stats["pool_error"]
        out[name] = {k: stats[k] for k in ("role", "state", "inflight", "num_running", "num_waiting",
                                             "num_free_blocks", "num_blocks", "prompt_tokens_total",
                                             "prefill_computed_tokens", "kv_received_bytes", "kv_sent_bytes")}
    return out


def auth_refusals(cluster, name: str) -> float:
    url = cluster.worker_url(name) + "/metrics"
    signed = ClusterAuth(cluster.cluster_secret).sign_request("GET", "/metrics", audience=cluster.worker_audience(name))
    status, body = call(url, "GET", None, signed)
    assert status == 200
    return sum(float(line.split()[-1]) for line in body.decode().splitlines()
               if line.startswith("pdserve_worker_auth_refused_total{"))


def test_every_endpoint_refuses_bad_credentials_and_nothing_changes(cluster):
    before = state(cluster)
    refusals_before = {n: auth_refusals(cluster, n) for n in ("p0", "d0")}
    expected_refusals = {"p0": 0, "d0": 0}
    audiences = {name: cluster.worker_audience(name) for name in ("p0", "d0")}
    for worker, method, path, body, extra in endpoints(cluster):
        for how, (sent_path, sent_body, creds) in forgeries(cluster.cluster_secret, audiences, worker, method, path,
                                                            body).items():
            status, answer = call(cluster.worker_url(worker) + sent_path, method, sent_body or None,
                                  {**extra, **creds})
            assert status == 401, f"{method} {path} with {how}: {status} {answer[:200]!r}"
            assert "cluster credentials" in json.loads(answer)["error"]
            expected_refusals[worker] += 1
    assert state(cluster) == before
    for name in ("p0", "d0"):
        assert auth_refusals(cluster, name) - refusals_before[name] == expected_refusals[name]
    assert call(cluster.worker_url("d0") + "/health", "GET", None, {})[0] == 200  # probes need no secret


def test_credentials_are_checked_before_the_body_is_read(cluster):
    """A declared body that never arrives: the worker answers 401 at once instead of waiting for it."""
    host, port = urllib.parse.urlsplit(cluster.worker_url("d0")).netloc.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n" + b"\x00" * 100)
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]


def test_credentials_are_verified_whole_before_the_body_is_read(cluster):
    """A stranger who builds fresh, well-formed credentials for this very worker run (its id and
    instance are no secret: /health names the instance) but cannot sign them gets its 401 without
    the worker waiting for the 4 MiB it declared (issue 27 security review: 2,048 such connections
    held ~8 GiB of a worker for 30 s)."""
    headers = ClusterAuth("a-stranger-secret-of-enough-length").sign_request(
        "POST", "/generate", b"\x00" * MAX_FRAME_BYTES, audience=cluster.worker_audience("d0"))
    host, port = urllib.parse.urlsplit(cluster.worker_url("d0")).netloc.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\n{head}Content-Length: {MAX_FRAME_BYTES}\r\n\r\n"
                     .encode() + b"\x00" * 100)
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 401") and b"wrong cluster credentials" in answer, answer[:300]


def test_a_body_over_the_limit_is_refused_before_it_is_read(cluster):
    secret = ClusterAuth(cluster.cluster_secret)
    headers = secret.sign_request("POST", "/generate", b"\x00" * (MAX_FRAME_BYTES + 1),
                                  audience=cluster.worker_audience("d0"))
    host, port = urllib.parse.urlsplit(cluster.worker_url("d0")).netloc.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\n{head}Content-Length: {MAX_FRAME_BYTES + 1}\r\n\r\n"
                     .encode())
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


class Stream:
    """A signed /generate on the decode worker, read frame by frame in a thread."""

    def __init__(self, cluster, request_id: str, max_tokens: int):
        body = encode(GenerateRequest(request_id=request_id, prompt_token_ids=PROMPT,
                                      sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                     ignore_eos=True)))
        headers = ClusterAuth(cluster.cluster_secret).sign_request("POST", "/generate", body,
                                                                   audience=cluster.worker_audience("d0"))
        req = urllib.request.Request(cluster.worker_url("d0") + "/generate", data=body, method="POST", headers=headers)
        self.resp = urllib.request.urlopen(req, timeout=120)
        self.frames: list[TokenFrame] = []
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while header := self.resp.read(4):
                self.frames.append(decode(self.resp.read(int.from_bytes(header, "big")), TokenFrame))
                self.first.set()
        except (http.client.IncompleteRead, OSError):
            pass  # the worker ended the stream (an abort)

    def result(self) -> TokenFrame:
        self.thread.join(120)
        assert not self.thread.is_alive(), "the stream never ended"
        return self.frames[-1]


def test_forged_abort_leaves_an_inflight_request_running(cluster):
    victim = Stream(cluster, "victim", max_tokens=900)
    assert victim.first.wait(60) and not victim.frames[0].error, victim.frames[:1]
    body = encode(AbortRequest("victim"))
    audiences = {name: cluster.worker_audience(name) for name in ("p0", "d0")}
    for how, (path, sent, creds) in forgeries(cluster.cluster_secret, audiences, "d0", "POST", "/abort", body).items():
        status, _ = call(cluster.worker_url("d0") + path, "POST", sent, creds)
        assert status == 401, how
    stats = cluster.stats("d0")
    assert stats["inflight"] == 1 and stats["num_running"] == 1, "a forged abort stopped the request"
    # The same abort, signed, does stop it: the forgeries above were refused, not ignored.
    answer = cluster.worker_json("d0", "/abort", "POST", body)
    assert answer == {"aborted": True}
    last = victim.result()
    assert last.finish_reason != "length" and sum(len(f.token_ids) for f in victim.frames) < 900


def test_signed_calls_are_served(cluster):
    stream = Stream(cluster, "signed-ok", max_tokens=5)
    last = stream.result()
    assert last.finished and last.finish_reason == "length"
    assert sum(len(f.token_ids) for f in stream.frames) == 5


def non_loopback_address() -> str | None:
    """This machine's address on its default route, if it has one besides loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent; this only picks the interface
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


def test_listeners_bind_loopback_by_default(cluster):
    """Workers started without --host / --kv-host listen on 127.0.0.1 only (HTTP and KV)."""
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    pools = http_json(f"{cluster.gateway_url}/admin/pools", headers={"X-Admin-Token": ADMIN_TOKEN})
    ports = [int(w["http_address"].rsplit(":", 1)[1]) for w in pools["workers"]]
    ports += [w["kv_address"]["port"] for w in pools["workers"]]
    assert len(ports) == 4 and all(w["kv_address"]["host"] == "127.0.0.1" for w in pools["workers"])
    for port in ports:
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address, port), timeout=10).close()


# ---- cluster auth v3: each signed request works once, on the worker run it was signed for --------
# The requests are signed the way the deployment's own tools sign them (for the audience of the
# worker's current run, as LocalStack.worker_json, the gateway and peers do), then sent as raw bytes.


def captured(cluster, worker: str, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> dict:
    """The headers of a signed call to ``worker``'s current run (not sent)."""
    signed = ClusterAuth(cluster.cluster_secret).sign_request(method, path, body,
                                                              audience=cluster.worker_audience(worker))
    return {**(headers or {}), **signed}


def send_raw(url: str, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[int, bytes]:
    """One request as exactly these bytes; (status, body) of the answer."""
    host, port = urllib.parse.urlsplit(url).netloc.split(":")
    head = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
    request = (method + b" " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + head
               + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def raw_headers(headers: dict) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode()) for k, v in headers.items()]


def test_a_captured_request_is_refused_when_replayed_to_the_same_worker(cluster):
    body = encode(AbortRequest("replay-me"))
    headers = captured(cluster, "d0", "POST", "/abort", body)
    first = send_raw(cluster.worker_url("d0"), b"POST", b"/abort", raw_headers(headers), body)
    assert first == (200, b'{"aborted": false}'), first
    for _ in range(2):
        status, answer = send_raw(cluster.worker_url("d0"), b"POST", b"/abort", raw_headers(headers), body)
        assert status == 401 and b"replayed" in answer, (status, answer)


def test_a_request_signed_for_one_worker_is_refused_by_another(cluster):
    """A captured drain for p0 does nothing on d0 (the issue's example: one drain, every worker)."""
    headers = captured(cluster, "p0", "POST", "/admin/drain", b"{}",
                       {"X-Admin-Token": ADMIN_TOKEN, "Content-Type": "application/json"})
    assert cluster.stats("d0")["state"] == "active"
    status, answer = send_raw(cluster.worker_url("d0"), b"POST", b"/admin/drain", raw_headers(headers), b"{}")
    assert status == 401 and b"another worker" in answer, (status, answer)
    assert b"p0" not in answer and b"d0" not in answer  # the refusal names no worker
    assert cluster.stats("d0")["state"] == "active"


def test_the_run_a_worker_publishes_is_the_one_it_verifies_for(cluster):
    """The instance in a worker's signed registry entry (what the gateway signs for) and in its
    /health (what tools read) is its verifier's: a call signed for it is served."""
    pools = http_json(f"{cluster.gateway_url}/admin/pools", headers={"X-Admin-Token": ADMIN_TOKEN})
    for worker in pools["workers"]:
        assert audience_of(worker["worker_id"], worker["instance"]) == cluster.worker_audience(worker["worker_id"])
    status, _ = send_raw(cluster.worker_url("d0"), b"GET", b"/stats", raw_headers(captured(cluster, "d0", "GET",
                                                                                          "/stats")), b"")
    assert status == 200


def test_worker_admin_calls_are_authorised_by_the_signature_not_by_an_admin_token(cluster):
    url = cluster.worker_url("d0")
    # Signed for d0, no admin token: served (the gateway's admin proxy sends nothing else).
    status, answer = send_raw(url, b"GET", b"/admin/status", raw_headers(captured(cluster, "d0", "GET", "/admin/status")),
                              b"")
    assert status == 200 and json.loads(answer)["worker_id"] == "d0", (status, answer)
    # The admin token alone, or a wrong one with a valid signature, is what it always was: nothing.
    status, _ = send_raw(url, b"POST", b"/admin/drain", [(b"X-Admin-Token", ADMIN_TOKEN.encode())], b"{}")
    assert status == 401
    assert cluster.stats("d0")["state"] == "active"


def test_a_caller_of_the_previous_auth_version_is_refused_with_a_message_naming_it(cluster):
    """A mixed-version cluster fails loudly: a v1 request, signed with the right secret (what a
    gateway or worker of the previous version sends), is a 401 that says why."""
    body = encode(AbortRequest("from-v1"))
    status, answer = send_raw(cluster.worker_url("d0"), b"POST", b"/abort",
                              raw_headers(v1_signature(cluster.cluster_secret, "POST", "/abort", body, time.time())), body)
    assert status == 401 and b"auth v1" in answer and b"older pdserve" in answer, (status, answer)


@pytest.mark.parametrize("name, value", [
    (b"X-PD-Signature", "\u00e9".encode() * 64),                     # non-ASCII signature
    (b"X-PD-Signature", b"\xff" * 64),                               # not even UTF-8
    (b"X-PD-Time", "\u00b2".encode() * 10),                          # digits to isdigit(), not to int()
    (b"X-PD-Time", None),                                            # this time in Arabic-Indic digits
    (b"X-PD-Time", "\uff11\uff17".encode() + b"0" * 8),              # fullwidth digits
    (b"X-PD-Nonce", "\u0660".encode() * 32),
    (b"X-PD-Audience", "d\u00e9".encode()),
    (b"X-PD-Auth", "\u0662".encode()),
    (b"X-PD-Body", "\u0663".encode() + b":" + b"0" * 64),
    (b"X-PD-Body", b"2:" + "\u00e9".encode() * 64),
])
def test_malformed_credentials_are_a_401_never_a_500(cluster, name, value):
    body = encode(AbortRequest("malformed"))
    headers = raw_headers(captured(cluster, "d0", "POST", "/abort", body))
    if value is None:
        stamp = dict(headers).get(b"X-PD-Time", str(int(time.time())).encode()).decode()
        value = "".join(chr(0x0660 + int(d)) for d in stamp).encode()
    headers = [(k, v) for k, v in headers if k != name] + [(name, value)]
    status, answer = send_raw(cluster.worker_url("d0"), b"POST", b"/abort", headers, body)
    assert status == 401 and b"cluster credentials" in answer, (status, answer[:200])


# Header values a stranger may send: any bytes HTTP allows in a value but white space (which the
# parser strips, so a value padded with it would be no change).
HEADER_BYTES = st.binary(max_size=80).map(lambda b: bytes(c for c in b if c > 0x20 and c != 0x7f))
DIGIT_SCRIPTS = [0x0660, 0x06F0, 0x0966, 0xFF10, 0x1D7CE]  # Arabic-Indic, Persian, Devanagari, fullwidth, math bold
SIGNED_NAMES = [b"X-PD-Auth", b"X-PD-Time", b"X-PD-Nonce", b"X-PD-Audience", b"X-PD-Body", b"X-PD-Signature"]


@st.composite
def mutations(draw):
    """(what changed, how to apply it to (method, target, headers, body))."""
    kind = draw(st.sampled_from(["method", "path", "body", "value", "digits", "case", "drop", "duplicate"]))
    if kind == "method":
        method = draw(st.sampled_from([b"GET", b"PUT", b"DELETE", b"PATCH"]))
        return f"method {method}", lambda m, t, h, b: (method, t, h, b)
    if kind == "path":
        target = draw(st.sampled_from([b"/abort/", b"/Abort", b"//abort", b"/abort?x=1", b"/abort?", b"/stats",
                                       b"/generate", b"/prefill", b"/admin/drain", b"/abort/..", b"/abort%20"])
                      | st.text("abcXYZ019-._~/=&?", min_size=1, max_size=12).map(lambda s: b"/abort" + s.encode()))
        return f"target {target}", lambda m, t, h, b: (m, target, h, b)
    if kind == "body":
        flip = draw(st.integers(0, 10_000))
        extra = draw(st.binary(max_size=8))

        def body(m, t, h, b):
            i = flip % len(b)
            return m, t, h, (b[:i] + bytes([b[i] ^ 0x01]) + b[i + 1:] if not extra else b + extra)
        return f"body (flip {flip}, append {extra})", body
    name = draw(st.sampled_from(SIGNED_NAMES))
    if kind == "value":
        value = draw(HEADER_BYTES)
        return f"{name} = {value}", lambda m, t, h, b: (m, t, [(k, value if k == name else v) for k, v in h], b)
    if kind == "digits":  # the same number in another script's digits (what int() and isdigit() accept)
        zero = draw(st.sampled_from(DIGIT_SCRIPTS))

        def digits(m, t, h, b):
            return m, t, [(k, "".join(chr(zero + int(c)) if c.isdigit() else c for c in v.decode()).encode()
                           if k == name else v) for k, v in h], b
        return f"{name} in digits from U+{zero:04X}", digits
    if kind == "case":
        return f"{name} swapcased", lambda m, t, h, b: (m, t, [(k, v.swapcase() if k == name else v) for k, v in h], b)
    if kind == "drop":
        return f"{name} dropped", lambda m, t, h, b: (m, t, [(k, v) for k, v in h if k != name], b)
    value = draw(st.none() | HEADER_BYTES)
    return (f"{name} twice", lambda m, t, h, b: (m, t, h + [(name, dict(h).get(name, b"") if value is None else value)],
                                                  b))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutation=mutations(), request_id=st.text("abcdef0123456789", min_size=1, max_size=16))
def test_any_change_to_a_signed_request_is_a_401_and_burns_nothing(cluster, mutation, request_id):
    """Whatever part of a signed request changes -- method, path, body, or any credential header's
    value, digits, case, presence or count -- the worker answers 401 (never a 500, never the
    handler), and the original, sent afterwards, is still accepted once: a refused request uses up
    no nonce (one whose body is not the signed one gives back the nonce its headers took)."""
    what, apply = mutation
    body = encode(AbortRequest(f"prop-{request_id}"))
    original = (b"POST", b"/abort", raw_headers(captured(cluster, "d0", "POST", "/abort", body)), body)
    changed = apply(*original)
    if changed == original or changed[1].split(b"?")[0] == b"/health":
        return  # no change after all (e.g. swapcase of digits), or the open probe path
    status, answer = send_raw(cluster.worker_url("d0"), *changed)
    assert status == 401, f"{what}: {status} {answer[:200]!r}"
    status, answer = send_raw(cluster.worker_url("d0"), *original)
    assert status == 200, f"after {what}, the original: {status} {answer[:200]!r}"
