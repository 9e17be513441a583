"""Who is calling: API keys, each with an optional limit on its requests in flight.

Keys come from ``--api-key`` (one key) and/or ``--api-keys-file``: one key per line, optionally
``key:limit``; blank lines and lines starting with ``#`` are skipped::

    # team-a may hold 32 requests in flight, team-b the --max-inflight-per-key default
    sk-team-a-3c1f0e...:32
    sk-team-b-9ab2d4...

A key without its own limit gets ``--max-inflight-per-key`` (0: no per-key limit).  By default,
when several keys share the gateway, that is half of ``--max-inflight``: no one key can take
every slot, and a single key may still use them all.  Beyond its limit a key's requests get 429
with Retry-After.  Likewise a key holds at most ``--queue-size-per-key`` places in the wait queue
(by default half of ``--queue-size`` when several keys share the gateway), 429 beyond
(``default_key_share`` says both defaults).

A presented key is looked up by its SHA-256 (no per-key string comparison, no timing signal about
how much of a key matched).  A key is named in logs by ``key_id``, a prefix of that hash, never by
the key itself; metrics per key are served to the admin only (``/admin/metrics``).

Prefix-cache isolation (``--cache-isolation``).  A client's ``cache_salt`` is always bound to its
API key: the salt served is an HMAC, keyed by the key's SHA-256, of the client's salt, so a salt
shares blocks only with requests of the same key and the same salt -- another key that guesses or
learns it shares nothing.  Then, with ``none``, requests without a salt are served without one and
share cached prompt blocks across keys (a common system prompt is computed once for everyone; the
price is that ``cached_tokens`` and time to first token can tell a key that another sent the same
prompt prefix).  With ``per-key`` requests without a salt are salted by their key too: two keys
never share a block, and ``cached_tokens`` tells a key only about its own prompts.  Without API
keys every caller is the same tenant and the client's salt is served as it is.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path

from common.cluster.credentials import bearer_token, credential_bytes


@dataclass(frozen=True)
class Tenant:
    """One API key's identity and limits.  ``limit``: requests in flight (None: only the global one)."""

    key_id: str
    limit: int | None = None
    key_digest: bytes = field(default=b"", repr=False)  # the key's SHA-256: keys its cache salts


ANONYMOUS = Tenant("anonymous")  # no API keys configured: everyone is the same caller

CACHE_ISOLATION = ("none", "per-key")


def cache_salt(tenant: Tenant, client_salt: str | None, isolation: str) -> str | None:
    """The ``cache_salt`` a request is served with (see the module docstring)."""
    assert isolation in CACHE_ISOLATION, f"unknown cache isolation {isolation!r}"
    if tenant.key_digest == b"" or (isolation == "none" and client_salt is None):
        return client_salt  # no API keys (one tenant), or shared on purpose
    message = b"pdserve cache salt\0" + (b"\1" + client_salt.encode() if client_salt is not None else b"\0")
    return "key-" + hmac.new(tenant.key_digest, message, hashlib.sha256).hexdigest()


def default_key_share(per_key: int | None, total: int | None, num_keys: int) -> int | None:
    """One key's share of a limit every key shares -- the requests in flight (``max_inflight``) of a
    key without its own limit, the places in the wait queue (``queue_size``) -- None: only the
    shared limit.  ``per_key`` when set (0: none); else half of ``total`` when several keys share it."""
    if per_key is not None:
        return per_key or None
    if total is None or num_keys < 2:
        return None
    return max(1, total // 2)


def _digest(key: str) -> bytes:
    return hashlib.sha256(credential_bytes(key)).digest()


def key_id(key: str) -> str:
    return "key-" + _digest(key).hex()[:12]


def parse_keys_file(text: str, source: str = "api keys file") -> dict[str, int | None]:
    """``{key: limit or None}``; raises ValueError naming the line of a malformed entry."""
    keys: dict[str, int | None] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, limit = line, None
        head, sep, tail = line.rpartition(":")
        if sep and tail.isdigit():
            key, limit = head, int(tail)
            if limit < 1:
                raise ValueError(f"{source} line {number}: a key's limit must be >= 1, got {limit}")
        if not key or any(c.isspace() for c in key):
            raise ValueError(f"{source} line {number}: expected 'key' or 'key:limit' (no spaces in a key)")
        if key in keys:
            raise ValueError(f"{source} line {number}: key {key_id(key)} is listed twice")
        keys[key] = limit
    return keys


def read_api_keys(api_key: str | None, api_keys_file: str | None) -> dict[str, int | None]:
    """``{key: its own limit or None}`` of ``--api-key`` and ``--api-keys-file`` (read once: check
    and serve the keys this returns, never a second reading of the file); raises ValueError."""
    keys: dict[str, int | None] = {}
    if api_keys_file:
        path = Path(api_keys_file)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ValueError(f"cannot read the API keys file {path}: {exc.strerror}") from None
        keys = parse_keys_file(text, str(path))
        if not keys:
            raise ValueError(f"the API keys file {path} lists no key")
    if api_key is not None:  # an empty key is listed, for the strength check to refuse
        keys.setdefault(api_key, None)
    return keys


class ApiKeys:
    """The keys a gateway accepts (``read_api_keys``), each with its limit or ``default_limit``.
    With none configured, every caller is ``ANONYMOUS``."""

    def __init__(self, keys: dict[str, int | None], default_limit: int | None = None):
        self._tenants = {_digest(k): Tenant(key_id(k), limit if limit is not None else default_limit, _digest(k))
                         for k, limit in keys.items()}
        if len({t.key_id for t in self._tenants.values()}) < len(self._tenants):  # (48 bits of their digests)
            raise ValueError("two API keys share a key id (the limits, metrics and stored responses it keys): "
                             "replace one of them")

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    @property
    def count(self) -> int:
        return len(self._tenants)

    def authenticate(self, authorization: str) -> Tenant | None:
        """The tenant for an ``Authorization`` header value, or None if it names no known key."""
        if not self.enabled:
            return ANONYMOUS
        token = bearer_token(authorization)
        return self._tenants.get(_digest(token)) if token else None
