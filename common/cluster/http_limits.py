"""What one HTTP listener lets a client hold: connections, and how long each may sit idle.

Every HTTP port of the system (the gateway's, each worker's) is served through
``common.cluster.http_listener`` with one ``HttpLimits``.  The defaults live here, once; the
services' flags take them from here (``add_http_flags``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

HELP = {
    "max_connections": "open client connections on the HTTP port; at the cap an idle one (waiting between "
                       "requests, or not done sending its headers) is closed for a newcomer, and only when "
                       "every one is busy with a request does the newcomer get 503 + Retry-After",
    "header_timeout": "seconds a client has to send a request's complete headers (from connecting, or from the "
                      "first byte of a later request on the connection); then the connection is closed",
    "keepalive_timeout": "seconds a connection may stay idle between requests before it is closed",
    "body_timeout": "seconds a request's body has, from its headers, to arrive in full; then 408 and close",
    "write_timeout": "seconds a client may leave the connection's send buffer full (taking no bytes of what it "
                     "is sent) before the connection is cut off; also the most a connection being closed may "
                     "take to receive what is left for it",
}


@dataclass(frozen=True)
class HttpLimits:
    """See ``HELP`` for each field.  ``keepalive_timeout`` is above the 15 s for which aiohttp's
    client (the gateway's and the workers' pools) keeps an idle connection: the client always
    gives up a pooled connection first, so it never sends a request on one the server is closing."""

    max_connections: int = 2048
    header_timeout: float = 10.0
    keepalive_timeout: float = 20.0
    body_timeout: float = 30.0
    write_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"invalid config: max_connections must be >= 1, got {self.max_connections}")
        for name in ("header_timeout", "keepalive_timeout", "body_timeout", "write_timeout"):
            value = getattr(self, name)
            if not 0 < value <= 86400:
                raise ValueError(f"invalid config: {name} must be in (0, 86400] seconds, got {value}")


DEFAULTS = HttpLimits()


def add_http_flags(add: Callable[..., None], prefix: str = "", names: tuple[str, ...] | None = None) -> None:
    """Declare ``--{prefix}max-connections`` etc. through a parser's ``add(flag, default, type, help=)``
    (the services' ``EnvFlags.add``), for the fields in ``names`` (default: all)."""
    for f in fields(HttpLimits):
        if names is None or f.name in names:
            add(f"--{prefix}{f.name.replace('_', '-')}", getattr(DEFAULTS, f.name), type(getattr(DEFAULTS, f.name)),
                help=HELP[f.name])


def http_limits_from_args(args: Any, prefix: str = "", **overrides: Any) -> HttpLimits:
    """The ``HttpLimits`` from parsed flags declared by ``add_http_flags(add, prefix)``."""
    dest = prefix.replace("-", "_")
    values = {f.name: getattr(args, dest + f.name) for f in fields(HttpLimits) if hasattr(args, dest + f.name)}
    return HttpLimits(**{**values, **overrides})
