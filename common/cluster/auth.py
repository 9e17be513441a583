"""The cluster secret: proof that a caller belongs to the deployment, for every internal channel.

Everything behind the gateway shares one secret (``PDSERVE_CLUSTER_SECRET``).  It never travels;
each channel uses a key derived from it for its own purpose, so a value signed for one channel is
worthless on another::

    secret --HMAC("pdserve/http/2")---> http key      signs internal HTTP requests (headers below)
           --HMAC("pdserve/registry")-> registry key  signs worker entries in Redis
           --HMAC("pdserve/kv")-------> kv key        KV-connection challenge-response

Internal HTTP request signature, cluster auth v2 (``ClusterAuth.sign_request``, checked by the
receiving worker's ``RequestVerifier``)::

    X-PD-Auth:      2                   the scheme's version
    X-PD-Time:      unix seconds        when it was signed (the verifier accepts +-MAX_CLOCK_SKEW_S)
    X-PD-Nonce:     32 lower-case hex   random, never used twice
    X-PD-Audience:  a worker id         the worker the request is for
    X-PD-Signature: 64 lower-case hex   HMAC-SHA256(http key, LP(METHOD) LP(PATH_QS) LP(TIME) LP(NONCE)
                                                                  LP(AUDIENCE) LP(SHA256(body)))

``LP(x)`` is ``x`` prefixed with its length (4 bytes, big-endian).  The receiving worker computes the
MAC with its *own* worker id, so a request signed for one worker is refused by every other (the
header only lets the refusal say so); and it remembers every accepted nonce until the request's
time is out of the skew window (``nonce_cache``), so a captured request is refused when replayed
to the same worker, and is stale by the time the nonce is forgotten.  A worker also refuses requests
signed before it started, since its previous run's nonces are gone.

Every header must be present once and match its exact ASCII form; anything else, a non-ASCII byte
or a Unicode digit included, is a 401 like a wrong signature.  A request whose credentials are
missing, malformed, of another version, for another worker, stale or already used is refused
before its body is read; one whose signature does not match the body is refused before the body
is decoded.  Callers sign each request right before sending it, and sign again to resend.

Versions: a request with ``X-PD-Time``/``X-PD-Signature`` but no ``X-PD-Auth`` comes from a v1
caller (no nonce, no audience, replayable) and is refused with a message saying so; registry entries
carry the version too (``registry.WorkerInfo.auth_version``), so a v2 reader ignores, with a warning
naming the version, the workers a v1 process registered.  A cluster runs one version.

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
import re
import secrets
import time
from typing import Callable, Iterable, Mapping

from common.cluster.nonce_cache import DEFAULT_CAPACITY, REPLAYED, NonceCache

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
MIN_SECRET_LEN = 16
MAX_CLOCK_SKEW_S = 300.0
AUTH_VERSION = 2
VERSION_HEADER = "X-PD-Auth"
TIME_HEADER = "X-PD-Time"
NONCE_HEADER = "X-PD-Nonce"
AUDIENCE_HEADER = "X-PD-Audience"
SIGNATURE_HEADER = "X-PD-Signature"
_PLACEHOLDER_PREFIXES = ("change-me", "changeme", "replace-me", "secret", "password", "example")
# The exact form of each header (explicit ASCII classes: ``\d`` and ``str.isdigit`` take any script's digits).
_HEADER_FORMS = {
    TIME_HEADER: re.compile(r"[0-9]{1,12}"),
    NONCE_HEADER: re.compile(r"[0-9a-f]{32}"),
    AUDIENCE_HEADER: re.compile(r"[A-Za-z0-9._:@-]{1,128}"),  # a worker id (registry.WorkerId)
    SIGNATURE_HEADER: re.compile(r"[0-9a-f]{64}"),
}
_SIGNED_HEADERS = (VERSION_HEADER, *_HEADER_FORMS)


class AuthError(Exception):
    """A request, entry or peer failed authentication (the message says why, never the secret).

    ``reason`` names the kind for metrics: credentials (missing, malformed, stale or wrong),
    version (another scheme version), audience (for another worker), replay (a nonce already
    used), replay_window (too old to tell, while the replay cache is full)."""

    def __init__(self, message: str, reason: str = "credentials"):
        super().__init__(message)
        self.reason = reason


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
        self._http = _derive(secret, b"http/%d" % AUTH_VERSION) if secret else b""
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

    # ---- internal HTTP ----------------------------------------------------------------------

    def sign_request(self, method: str, path_qs: str, body: bytes = b"", *, audience: str,
                     now: float | None = None) -> dict[str, str]:
        """Headers proving the caller holds the secret, for one request to the worker ``audience``
        (its worker id); ``{}`` when auth is disabled.  Sign each request right before sending it:
        the verifier refuses a second use of the same headers."""
        if not self.enabled:
            return {}
        if not isinstance(audience, str) or not _HEADER_FORMS[AUDIENCE_HEADER].fullmatch(audience):
            raise ValueError(f"audience {audience!r} is not a worker id")
        stamp = str(int(time.time() if now is None else now))
        nonce = secrets.token_hex(16)
        return {VERSION_HEADER: str(AUTH_VERSION), TIME_HEADER: stamp, NONCE_HEADER: nonce,
                AUDIENCE_HEADER: audience,
                SIGNATURE_HEADER: self._request_mac(method, path_qs, stamp, nonce, audience, body)}

    def request_verifier(self, audience: str, *, clock: Callable[[], float] = time.time,
                         max_nonces: int = DEFAULT_CAPACITY) -> "RequestVerifier":
        """The verifier of requests signed for the worker ``audience`` (one per worker process)."""
        return RequestVerifier(self, audience, clock=clock, max_nonces=max_nonces)

    def _request_mac(self, method: str, path_qs: str, stamp: str, nonce: str, audience: str, body: bytes) -> str:
        mac = hmac.new(self._http, digestmod=hashlib.sha256)
        # surrogatepass: a path aiohttp decoded from non-UTF-8 bytes still encodes (and matches nothing).
        for part in (method.upper(), path_qs, stamp, nonce, audience):
            _update_lp(mac, part.encode("utf-8", "surrogatepass"))
        _update_lp(mac, hashlib.sha256(body).digest())
        return mac.hexdigest()

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
            _update_lp(mac, part)
        return mac.digest()

    def kv_proof_matches(self, expected_parts: tuple[bytes, ...], proof: bytes) -> bool:
        if not self.enabled:
            return True
        return hmac.compare_digest(self.kv_proof(*expected_parts), proof)


class SignedCredentials:
    """The well-formed credential headers of one request (``RequestVerifier.check_headers``)."""

    __slots__ = ("stamp", "nonce", "signature", "acceptable_until")

    def __init__(self, stamp: str, nonce: str, signature: str):
        self.stamp, self.nonce, self.signature = stamp, nonce, signature
        self.acceptable_until = int(stamp) + MAX_CLOCK_SKEW_S


class RequestVerifier:
    """Checks requests signed for one worker (``audience``, its worker id) and refuses replays.

    Two stages, so that a request is refused before its body is read whenever its headers suffice:
    ``check_headers`` (present once, exact form, this version, this worker, fresh, nonce not
    used), then ``verify`` with the body (the signature matches, and the nonce is remembered;
    refused if another request with it was accepted meanwhile).  With auth disabled both accept
    everything.  ``clock`` is unix time (tests pass their own).  One event loop uses it."""

    def __init__(self, auth: ClusterAuth, audience: str, *, clock: Callable[[], float] = time.time,
                 max_nonces: int = DEFAULT_CAPACITY):
        if not _HEADER_FORMS[AUDIENCE_HEADER].fullmatch(audience):
            raise ValueError(f"audience {audience!r} is not a worker id")
        self.auth = auth
        self.audience = audience
        self.clock = clock
        self.seen = NonceCache(max_nonces)
        # The nonces a previous run of this worker accepted are gone: requests signed before this
        # run began are refused, so none of them can be replayed to it (a caller whose clock lags
        # this one's gets 401s only until its clock passes this second).
        self.signed_not_before = int(clock())

    def check_headers(self, headers: Mapping[str, str]) -> SignedCredentials | None:
        """The request's credentials if its headers pass every check that needs no body (None when
        auth is disabled); raises ``AuthError`` naming the problem otherwise."""
        if not self.auth.enabled:
            return None
        values = {name: _single(headers, name) for name in _SIGNED_HEADERS}
        version = values[VERSION_HEADER]
        if version is None:
            if values[TIME_HEADER] is not None or values[SIGNATURE_HEADER] is not None:
                raise AuthError(f"cluster credentials of auth v1 (no {VERSION_HEADER} header): this worker accepts "
                                f"v{AUTH_VERSION} only; the caller runs an older pdserve (one version per cluster)",
                                "version")
            raise AuthError("missing cluster credentials")
        if version != str(AUTH_VERSION):
            shown = f" {version}" if re.fullmatch(r"[0-9]{1,3}", version) else ""
            raise AuthError(f"cluster credentials of another auth version{shown}: this worker accepts v{AUTH_VERSION} "
                            "only (one pdserve version per cluster)", "version")
        for name, form in _HEADER_FORMS.items():
            value = values[name]
            if value is None:
                raise AuthError(f"missing cluster credentials ({name})")
            if not form.fullmatch(value):
                raise AuthError(f"malformed cluster credentials ({name})")
        if values[AUDIENCE_HEADER] != self.audience:
            raise AuthError(f"cluster credentials for worker {values[AUDIENCE_HEADER]!r}, not for this worker "
                            f"({self.audience!r})", "audience")
        creds = SignedCredentials(values[TIME_HEADER], values[NONCE_HEADER], values[SIGNATURE_HEADER])
        now = self.clock()
        if abs(now - int(creds.stamp)) > MAX_CLOCK_SKEW_S:
            raise AuthError("stale cluster credentials (signed more than "
                            f"{MAX_CLOCK_SKEW_S:.0f} s away from this worker's clock)")
        if int(creds.stamp) < self.signed_not_before:
            raise AuthError("cluster credentials signed before this worker started (a replay from its previous run, "
                            "or the caller's clock is behind this worker's)", "replay_window")
        why = self.seen.refusal(creds.nonce, creds.acceptable_until, now)
        if why is not None:
            raise AuthError(why, "replay" if why == REPLAYED else "replay_window")
        return creds

    def verify(self, method: str, path_qs: str, creds: SignedCredentials | None, body: bytes) -> None:
        """Raise ``AuthError`` unless ``creds`` (from ``check_headers``) sign exactly this method,
        path and body for this worker, and were not used before; remembers their nonce."""
        if not self.auth.enabled:
            return
        expected = self.auth._request_mac(method, path_qs, creds.stamp, creds.nonce, self.audience, body)
        if not hmac.compare_digest(expected, creds.signature):  # both ASCII: checked by check_headers
            raise AuthError("wrong cluster credentials")
        why = self.seen.remember(creds.nonce, creds.acceptable_until, self.clock())
        if why is not None:
            raise AuthError(why, "replay" if why == REPLAYED else "replay_window")

    def verify_request(self, method: str, path_qs: str, headers: Mapping[str, str], body: bytes) -> None:
        """Both stages at once (callers that have the body already)."""
        self.verify(method, path_qs, self.check_headers(headers), body)


def _single(headers: Mapping[str, str], name: str) -> str | None:
    """The header's one value; AuthError when it is given more than once."""
    getall = getattr(headers, "getall", None)
    if getall is not None:
        values = getall(name, [])
        if len(values) > 1:
            raise AuthError(f"malformed cluster credentials ({name} given {len(values)} times)")
        return values[0] if values else None
    return headers.get(name)


def _update_lp(mac, part: bytes) -> None:
    mac.update(len(part).to_bytes(4, "big"))
    mac.update(part)


def _derive(secret: bytes, purpose: bytes) -> bytes:
    return hmac.new(secret, b"pdserve/" + purpose, hashlib.sha256).digest()
