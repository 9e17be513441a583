"""The cluster secret: proof that a caller belongs to the deployment, for every internal channel.

Everything behind the gateway shares one secret (``PDSERVE_CLUSTER_SECRET``).  It never travels;
each channel uses a key derived from it for its own purpose, so a value signed for one channel is
worthless on another::

    secret --HMAC("pdserve/http/3")---> http key      signs internal HTTP requests (headers below)
           --HMAC("pdserve/registry")-> registry key  signs worker entries in Redis
           --HMAC("pdserve/kv")-------> kv key        KV-connection challenge-response

Internal HTTP request signature, cluster auth v3 (``ClusterAuth.sign_request``, checked by the
receiving worker's ``RequestVerifier``)::

    X-PD-Auth:      3                   the scheme's version
    X-PD-Time:      unix seconds        when it was signed (the verifier accepts +-MAX_CLOCK_SKEW_S)
    X-PD-Nonce:     32 lower-case hex   random, never used twice
    X-PD-Audience:  WORKER_ID/INSTANCE  the worker the request is for, and which run of it
    X-PD-Body:      LENGTH:SHA256HEX    the body's length in bytes (decimal) and SHA-256 (lower-case hex)
    X-PD-Signature: 64 lower-case hex   HMAC-SHA256(http key, LP(METHOD) LP(PATH_QS) LP(TIME) LP(NONCE)
                                                                  LP(AUDIENCE) LP(BODY))

``LP(x)`` is ``x`` (the header's exact text; METHOD upper-case, PATH_QS the request target as sent)
prefixed with its length (4 bytes, big-endian).  Everything the MAC covers is in the headers, so
the worker verifies it before it reads a byte of the body, then reads exactly the declared length
(``Content-Length`` must say the same, and no more than the worker's body limit) and compares the
hash: a caller without the secret never gets a body read.

The audience names the worker (its id) and its run: every worker process draws a random
``INSTANCE`` (``new_instance_id``) when it starts and publishes it in its signed registry entry
(``WorkerInfo.instance``, ``WorkerInfo.audience``) and its ``/health``.  The worker computes the
MAC with its *own* audience, so a request signed for one worker, or for an earlier run of the same
worker, is refused (the refusal names neither).  Within a run, the worker remembers every accepted
nonce until the request's time is out of the skew window (``nonce_cache``), so a captured request
is refused when replayed, and is stale by the time the nonce is forgotten.  A restarted worker has
a new instance, so nothing signed for its previous run -- whatever the signer's clock said --
is accepted by it.  Callers take the audience from the worker's current registry entry (its
``/health`` for tools outside the cluster plane); one signed for a worker that restarted since is
refused with reason "audience", and the caller's next read of the registry has the new one.

Every header must be present once and match its exact ASCII form; anything else, a non-ASCII byte
or a Unicode digit included, is a 401 like a wrong signature.  A request whose credentials are
missing, malformed, of another version, for another worker or run, stale, wrongly signed or already
used is refused before its body is read; one whose body is not the one signed is refused after it
was read, before it is decoded, and its nonce stays usable (nothing was done with it).  Callers
sign each request right before sending it, and sign again to resend.

Versions: v3 replaced v2 on the day v2 landed (v2's MAC covered the body, so the worker had to read
a stranger's body before it could check anything; and its audience had no run, so a request
stamped in the worker's future could be replayed to it after a restart).  v2 and v3 derive
different keys and are refused by each other with a message naming the version; a request with
``X-PD-Time``/``X-PD-Signature`` but no ``X-PD-Auth`` comes from a v1 caller (no nonce, no audience,
replayable) and is refused with a message saying so.  Registry entries carry the version too
(``registry.WorkerInfo.auth_version``), so a reader ignores, with a warning naming the version, the
workers a process of another version registered.  A cluster runs one version.

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

from common.cluster.credentials import header_values
from common.cluster.nonce_cache import DEFAULT_CAPACITY, REPLAYED, NonceCache
from common.cluster.redis_keys import WORKER_ID_RE

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
MIN_SECRET_LEN = 16
MAX_CLOCK_SKEW_S = 300.0
AUTH_VERSION = 3
VERSION_HEADER = "X-PD-Auth"
TIME_HEADER = "X-PD-Time"
NONCE_HEADER = "X-PD-Nonce"
AUDIENCE_HEADER = "X-PD-Audience"
BODY_HEADER = "X-PD-Body"
SIGNATURE_HEADER = "X-PD-Signature"
INSTANCE_RE = re.compile(r"[0-9a-f]{32}")  # a worker run's instance id (new_instance_id)
_PLACEHOLDER_PREFIXES = ("change-me", "changeme", "replace-me", "secret", "password", "example")
# The exact form of each header (explicit ASCII classes: ``\d`` and ``str.isdigit`` take any script's digits).
_HEADER_FORMS = {
    TIME_HEADER: re.compile(r"[0-9]{1,12}"),
    NONCE_HEADER: re.compile(r"[0-9a-f]{32}"),
    AUDIENCE_HEADER: re.compile(rf"{WORKER_ID_RE.pattern}/{INSTANCE_RE.pattern}"),  # audience_of(id, instance)
    BODY_HEADER: re.compile(r"(0|[1-9][0-9]{0,11}):[0-9a-f]{64}"),
    SIGNATURE_HEADER: re.compile(r"[0-9a-f]{64}"),
}
_SIGNED_HEADERS = (VERSION_HEADER, *_HEADER_FORMS)


class AuthError(Exception):
    """A request, entry or peer failed authentication (the message says why, never the secret).

    ``reason`` names the kind for metrics: credentials (missing, malformed, stale or wrong, or a
    body that is not the one signed), version (another scheme version), audience (for another
    worker, or another run of this one), replay (a nonce already used), replay_window (too old to
    tell, while the replay cache is full)."""

    def __init__(self, message: str, reason: str = "credentials"):
        super().__init__(message)
        self.reason = reason


def generate_secret() -> str:
    """A fresh random secret (256 bits, URL-safe text) that does not start with "-" (a command line
    would read it as a flag: ``--admin-token -x...`` is "expected one argument")."""
    while (secret := secrets.token_urlsafe(32)).startswith("-"):
        pass
    return secret


def new_instance_id() -> str:
    """A fresh instance id for one run of a worker (the second half of its audience)."""
    return secrets.token_hex(16)


def audience_of(worker_id: str, instance: str) -> str:
    """The audience a request for run ``instance`` of worker ``worker_id`` is signed for (what
    ``WorkerInfo.audience`` gives); ValueError when either is malformed."""
    if not isinstance(worker_id, str) or not WORKER_ID_RE.fullmatch(worker_id):
        raise ValueError(f"{worker_id!r} is not a worker id")
    if not isinstance(instance, str) or not INSTANCE_RE.fullmatch(instance):
        raise ValueError(f"instance of worker {worker_id!r} is not 32 lower-case hex digits")
    return f"{worker_id}/{instance}"


def body_digest(body: bytes) -> str:
    """The ``X-PD-Body`` value of ``body``: its length and SHA-256."""
    return f"{len(body)}:{hashlib.sha256(body).hexdigest()}"


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
        """Headers proving the caller holds the secret, for one request with exactly this method,
        request target and body, to the worker run ``audience`` (``WorkerInfo.audience``, i.e.
        ``audience_of(worker_id, instance)``); ``{}`` when auth is disabled.  Sign each request
        right before sending it: the verifier refuses a second use of the same headers."""
        if not isinstance(audience, str) or not _HEADER_FORMS[AUDIENCE_HEADER].fullmatch(audience):
            raise ValueError(f"audience {audience!r} is not WORKER_ID/INSTANCE (WorkerInfo.audience)")
        if not self.enabled:
            return {}
        stamp = str(int(time.time() if now is None else now))
        nonce = secrets.token_hex(16)
        digest = body_digest(body)
        return {VERSION_HEADER: str(AUTH_VERSION), TIME_HEADER: stamp, NONCE_HEADER: nonce,
                AUDIENCE_HEADER: audience, BODY_HEADER: digest,
                SIGNATURE_HEADER: self._request_mac(method, path_qs, stamp, nonce, audience, digest)}

    def request_verifier(self, worker_id: str, instance: str | None = None, *,
                         clock: Callable[[], float] = time.time,
                         max_nonces: int = DEFAULT_CAPACITY) -> "RequestVerifier":
        """The verifier of requests signed for run ``instance`` of the worker ``worker_id`` (one
        per worker process; a fresh instance id when None)."""
        return RequestVerifier(self, worker_id, instance, clock=clock, max_nonces=max_nonces)

    def _request_mac(self, method: str, path_qs: str, stamp: str, nonce: str, audience: str, digest: str) -> str:
        mac = hmac.new(self._http, digestmod=hashlib.sha256)
        # surrogatepass: a path aiohttp decoded from non-UTF-8 bytes still encodes (and matches nothing).
        for part in (method.upper(), path_qs, stamp, nonce, audience, digest):
            _update_lp(mac, part.encode("utf-8", "surrogatepass"))
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
    """What a request's verified headers promise about its body (``RequestVerifier.verify_headers``)."""

    __slots__ = ("nonce", "acceptable_until", "body_length", "body_sha256")

    def __init__(self, stamp: str, nonce: str, digest: str):
        self.nonce = nonce
        self.acceptable_until = int(stamp) + MAX_CLOCK_SKEW_S
        length, _, sha256 = digest.partition(":")
        self.body_length = int(length)
        self.body_sha256 = bytes.fromhex(sha256)


class RequestVerifier:
    """Checks requests signed for one run of one worker (``audience``: its worker id and
    ``instance``) and refuses replays.

    Two stages, so that nothing of a request is read before its headers are proven:
    ``verify_headers`` (present once, exact form, this version, this worker and run, fresh, the
    signature matches, the nonce unused -- and now taken), then ``verify_body`` (the body read is
    the one the headers promise).  A request that passed the first stage but is not served after
    all (its body does not match, never arrives, or its caller leaves) gives its nonce back with
    ``release``.  With auth disabled all accept everything.  ``clock`` is unix time (tests pass
    their own).  One event loop uses it."""

    def __init__(self, auth: ClusterAuth, worker_id: str, instance: str | None = None, *,
                 clock: Callable[[], float] = time.time, max_nonces: int = DEFAULT_CAPACITY):
        self.instance = new_instance_id() if instance is None else instance
        self.audience = audience_of(worker_id, self.instance)
        self.worker_id = worker_id
        self.auth = auth
        self.clock = clock
        self.seen = NonceCache(max_nonces)

    def verify_headers(self, method: str, path_qs: str, headers: Mapping[str, str]) -> SignedCredentials | None:
        """The promise about the body of a request whose headers pass every check (None when auth
        is disabled), its nonce taken; raises ``AuthError`` naming the problem otherwise."""
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
            # Neither audience is named: the refusal tells a stranger nothing about this worker.
            raise AuthError("cluster credentials for another worker, or for an earlier run of this one (sign for "
                            "the audience of its current registry entry)", "audience")
        stamp, nonce = values[TIME_HEADER], values[NONCE_HEADER]
        now = self.clock()
        if abs(now - int(stamp)) > MAX_CLOCK_SKEW_S:
            raise AuthError("stale cluster credentials (signed more than "
                            f"{MAX_CLOCK_SKEW_S:.0f} s away from this worker's clock)")
        # The MAC with this worker's own audience (equal to the header's, checked above).
        expected = self.auth._request_mac(method, path_qs, stamp, nonce, self.audience, values[BODY_HEADER])
        if not hmac.compare_digest(expected, values[SIGNATURE_HEADER]):  # both ASCII: checked above
            raise AuthError("wrong cluster credentials")
        creds = SignedCredentials(stamp, nonce, values[BODY_HEADER])
        why = self.seen.remember(nonce, creds.acceptable_until, now)
        if why is not None:
            raise AuthError(why, "replay" if why == REPLAYED else "replay_window")
        return creds

    def verify_body(self, creds: SignedCredentials | None, body: bytes) -> None:
        """Raise ``AuthError`` unless ``body`` is the one ``creds`` (from ``verify_headers``) promise."""
        if creds is None:
            return
        if len(body) != creds.body_length or not hmac.compare_digest(hashlib.sha256(body).digest(),
                                                                       creds.body_sha256):
            raise AuthError("the body is not the one the cluster credentials were signed for")

    def release(self, creds: SignedCredentials | None) -> None:
        """The request of ``creds`` was not served after all: its nonce may be used once more."""
        if creds is not None:
            self.seen.release(creds.nonce)

    def verify_request(self, method: str, path_qs: str, headers: Mapping[str, str], body: bytes) -> None:
        """Both stages at once (callers that have the body already)."""
        creds = self.verify_headers(method, path_qs, headers)
        try:
            self.verify_body(creds, body)
        except AuthError:
            self.release(creds)
            raise


def _single(headers: Mapping[str, str], name: str) -> str | None:
    """The header's one value; AuthError when it is given more than once."""
    values = header_values(headers, name)
    if len(values) > 1:
        raise AuthError(f"malformed cluster credentials ({name} given {len(values)} times)")
    return values[0] if values else None


def _update_lp(mac, part: bytes) -> None:
    mac.update(len(part).to_bytes(4, "big"))
    mac.update(part)


def _derive(secret: bytes, purpose: bytes) -> bytes:
    return hmac.new(secret, b"pdserve/" + purpose, hashlib.sha256).digest()
