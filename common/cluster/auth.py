"""The cluster secret: proof that a caller belongs to the deployment, for every internal channel.

Everything behind the gateway shares one secret (``PDSERVE_CLUSTER_SECRET``).  It never travels;
each channel uses a key derived from it for its own purpose, so a value signed for one channel is
worthless on another::

    secret --HMAC("pdserve/http")-----> http key      signs internal HTTP requests (headers below)
           --HMAC("pdserve/registry")-> registry key  signs worker entries in Redis
           --HMAC("pdserve/kv")-------> kv key        KV-connection challenge-response

Internal HTTP request signature (``ClusterAuth.sign_request`` / ``verify_request``)::

    X-PD-Time:      unix seconds (the verifier accepts +-MAX_CLOCK_SKEW_S)
    X-PD-Signature: hex HMAC-SHA256(http key, METHOD \\n PATH_QS \\n TIME \\n SHA256(body))

A request whose headers are missing, malformed or stale is refused before its body is read; one
whose signature does not match the body is refused before the body is decoded.

No secret configured (``ClusterAuth.disabled()``): allowed only when every listener is on loopback
(``require_secret``); then nothing is signed or checked.

Every service builds its ``ClusterAuth`` with ``configure_auth`` from ``read_secret`` (a file, for
compose secrets, or ``PDSERVE_CLUSTER_SECRET``), which refuses weak secrets and exposed listeners
without one.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import time
from typing import Iterable, Mapping

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
MIN_SECRET_LEN = 16
MAX_CLOCK_SKEW_S = 300.0
TIME_HEADER = "X-PD-Time"
SIGNATURE_HEADER = "X-PD-Signature"
_PLACEHOLDER_PREFIXES = ("change-me", "changeme", "replace-me", "secret", "password", "example")


class AuthError(Exception):
    """A request, entry or peer failed authentication (the message says why, never the secret)."""


def generate_secret() -> str:
    """A fresh random secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def secret_problem(value: str | None) -> str | None:
    """Why ``value`` is not acceptable as a secret (empty, a placeholder, too short), or None."""
    if not value:
        return "it is empty"
    lowered = value.strip().lower()
    if any(lowered.startswith(p) for p in _PLACEHOLDER_PREFIXES):
        return "it is a placeholder value"
    if len(value) < MIN_SECRET_LEN:
        return f"it is shorter than {MIN_SECRET_LEN} characters"
    return None


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname: assume other machines can reach it


def read_secret(secret_file: str | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The cluster secret: the contents of ``secret_file`` (surrounding whitespace stripped) when
    given, else ``PDSERVE_CLUSTER_SECRET`` (an empty variable means unset); None when neither."""
    if secret_file:
        try:
            with open(secret_file, encoding="utf-8") as f:
                return f.read().strip() or None
        except OSError as exc:
            raise AuthError(f"cannot read the cluster secret file {secret_file}: {exc.strerror or exc}") from None
    env = os.environ if env is None else env
    return env.get(SECRET_ENV) or None


def configure_auth(secret: str | None, listen_hosts: Iterable[str], what: str) -> "ClusterAuth":
    """The ``ClusterAuth`` a service runs with; raises ``AuthError`` with a message saying what to do
    when the secret is weak, or missing while a listener is reachable from other machines."""
    if secret is not None:
        problem = secret_problem(secret)
        if problem:
            raise AuthError(
                f"the cluster secret ({SECRET_ENV}) is not acceptable: {problem}; generate one with "
                f"`python -c 'import secrets; print(secrets.token_urlsafe(32))'` and give every process of "
                f"the deployment the same value")
    auth = ClusterAuth(secret)
    auth.require_secret(listen_hosts, what)
    return auth


class ClusterAuth:
    """Signs and verifies with keys derived from the cluster secret; see the module docstring."""

    def __init__(self, secret: str | bytes | None):
        if isinstance(secret, str):
            secret = secret.encode()
        self.enabled = bool(secret)
        self._http = _derive(secret, b"http") if secret else b""
        self._registry = _derive(secret, b"registry") if secret else b""
        self._kv = _derive(secret, b"kv") if secret else b""

    @classmethod
    def disabled(cls) -> "ClusterAuth":
        return cls(None)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ClusterAuth":
        env = os.environ if env is None else env
        return cls(env.get(SECRET_ENV) or None)

    def require_secret(self, listen_hosts: Iterable[str], what: str = "this process") -> None:
        """Refuse to run without a secret when any listener is reachable from other machines."""
        exposed = [h for h in listen_hosts if not is_loopback(h)]
        if exposed and not self.enabled:
            raise AuthError(
                f"{what} listens on {', '.join(sorted(set(exposed)))}, which other machines can reach, but no "
                f"cluster secret is set: set {SECRET_ENV} to the same random value on every process of the "
                f"deployment (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`), or bind "
                f"to 127.0.0.1")

    # ---- internal HTTP -------------------------------------------------------------------

    def sign_request(self, method: str, path_qs: str, body: bytes = b"", now: float | None = None) -> dict[str, str]:
        """Headers proving the caller holds the secret; ``{}`` when auth is disabled."""
        if not self.enabled:
            return {}
        stamp = str(int(time.time() if now is None else now))
        return {TIME_HEADER: stamp, SIGNATURE_HEADER: self._request_mac(method, path_qs, stamp, body)}

    def check_request_headers(self, headers: Mapping[str, str], now: float | None = None) -> None:
        """Cheap checks before the body is read: headers present, well formed and fresh."""
        if not self.enabled:
            return
        stamp, signature = headers.get(TIME_HEADER), headers.get(SIGNATURE_HEADER)
        if not stamp or not signature:
            raise AuthError("missing cluster credentials")
        if not stamp.isdigit() or len(stamp) > 12 or len(signature) != 64:
            raise AuthError("malformed cluster credentials")
        now = time.time() if now is None else now
        if abs(now - int(stamp)) > MAX_CLOCK_SKEW_S:
            raise AuthError("stale cluster credentials (clock skew above "
                            f"{MAX_CLOCK_SKEW_S:.0f} s, or a replayed request)")

    def verify_request(self, method: str, path_qs: str, headers: Mapping[str, str], body: bytes,
                       now: float | None = None) -> None:
        """Raise ``AuthError`` unless the headers sign exactly this method, path and body."""
        if not self.enabled:
            return
        self.check_request_headers(headers, now)
        expected = self._request_mac(method, path_qs, headers[TIME_HEADER], body)
        if not hmac.compare_digest(expected, headers[SIGNATURE_HEADER].lower()):
            raise AuthError("wrong cluster credentials")

    def _request_mac(self, method: str, path_qs: str, stamp: str, body: bytes) -> str:
        message = b"\n".join([method.upper().encode(), path_qs.encode(), stamp.encode(),
                              hashlib.sha256(body).digest()])
        return hmac.new(self._http, message, hashlib.sha256).hexdigest()

    # ---- registry entries ----------------------------------------------------------------

    def sign_entry(self, payload: bytes) -> str:
        """Hex signature of a registry entry's bytes (``""`` when auth is disabled)."""
        if not self.enabled:
            return ""
        return hmac.new(self._registry, payload, hashlib.sha256).hexdigest()

    def verify_entry(self, payload: bytes, signature: str) -> bool:
        """Whether ``signature`` signs ``payload``; always True when auth is disabled."""
        if not self.enabled:
            return True
        return hmac.compare_digest(self.sign_entry(payload), signature or "")

    # ---- KV connections ------------------------------------------------------------------

    def kv_proof(self, *parts: bytes) -> bytes:
        """HMAC over length-prefixed ``parts`` with the KV key (challenge-response, both ways)."""
        mac = hmac.new(self._kv, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(len(part).to_bytes(4, "big"))
            mac.update(part)
        return mac.digest()

    def kv_proof_matches(self, expected_parts: tuple[bytes, ...], proof: bytes) -> bool:
        if not self.enabled:
            return True
        return hmac.compare_digest(self.kv_proof(*expected_parts), proof)


def _derive(secret: bytes, purpose: bytes) -> bytes:
    return hmac.new(secret, b"pdserve/" + purpose, hashlib.sha256).digest()
