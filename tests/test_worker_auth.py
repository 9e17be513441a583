"""Every worker endpoint but /health refuses callers without the cluster secret, before reading the
body, and nothing happens: no request admitted, no block allocated, no abort, no drain, no role change.

A real stack (1 prefill + 1 decode worker, real Redis, the gateway): the test holds the stack's
secret, so it can also show that the same calls, correctly signed, do take effect.
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from common.cluster.auth import MAX_CLOCK_SKEW_S, ClusterAuth
from common.cluster.messages import (
    MAX_FRAME_BYTES, AbortRequest, GenerateRequest, PrefillRequest, TokenFrame, decode, encode,
)
from common.engine.sampling_params import SamplingParams
from tests.cluster import ADMIN_TOKEN, http_json, running_cluster

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
                                    kv_transfer_id="0" * 32))
    admin = {"X-Admin-Token": ADMIN_TOKEN, "Content-Type": "application/json"}
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


def forgeries(secret: str, method: str, path: str, body: bytes) -> dict[str, tuple[str, bytes, dict]]:
    """Ways to call without valid credentials: (path sent, body sent, auth headers) by name."""
    right, wrong = ClusterAuth(secret), ClusterAuth("a-different-secret-of-enough-length")
    if body:
        tampered = (path, body[:-1] + bytes([body[-1] ^ 1]), right.sign_request(method, path, body))
    else:  # nothing to tamper with in a GET body: the signature is for another path
        tampered = (path, body, right.sign_request(method, path + "x", body))
    return {
        "no credentials": (path, body, {}),
        "wrong secret": (path, body, wrong.sign_request(method, path, body)),
        "tampered": tampered,
        "stale": (path, body, right.sign_request(method, path, body, now=time.time() - MAX_CLOCK_SKEW_S - 60)),
        "malformed": (path, body, {"X-PD-Time": "soon", "X-PD-Signature": "00"}),
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
    signed = ClusterAuth(cluster.cluster_secret).sign_request("GET", "/metrics")
    status, body = call(url, "GET", None, signed)
    assert status == 200
    return sum(float(line.split()[-1]) for line in body.decode().splitlines()
               if line.startswith("pdserve_worker_auth_refused_total{"))


def test_every_endpoint_refuses_bad_credentials_and_nothing_changes(cluster):
    before = state(cluster)
    refusals_before = {n: auth_refusals(cluster, n) for n in ("p0", "d0")}
    expected_refusals = {"p0": 0, "d0": 0}
    for worker, method, path, body, extra in endpoints(cluster):
        for how, (sent_path, sent_body, creds) in forgeries(cluster.cluster_secret, method, path, body).items():
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


def test_a_body_over_the_limit_is_refused_before_it_is_read(cluster):
    secret = ClusterAuth(cluster.cluster_secret)
    headers = secret.sign_request("POST", "/generate", b"whatever")  # fresh and well formed, body unknown
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
        headers = ClusterAuth(cluster.cluster_secret).sign_request("POST", "/generate", body)
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
    for how, (path, sent, creds) in forgeries(cluster.cluster_secret, "POST", "/abort", body).items():
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
