"""Secrets in a service's configuration: where each one comes from, the checks it passes, and the
rule that none is ever printed.

Every secret a service takes (the admin token, API keys, the Redis password, the metrics proxy's
token; the cluster secret through ``auth.read_secret``) comes from, first match wins::

    --NAME VALUE          the command line: accepted, with a warning that names the flag (never the
                          value): every user of the machine reads a command line (ps, /proc/PID/cmdline)
    --NAME-file PATH      a file (Docker or Kubernetes secrets), also PDSERVE_NAME_FILE; surrounding
                          whitespace is stripped, and an empty file is an empty (refused) secret
    PDSERVE_NAME          the environment

Every secret passes ``auth.secret_problem`` (not empty, not a placeholder, 16 characters or more),
wherever the service listens, and no two of them may be equal: an admin token equal to the cluster
secret would make every worker an operator, an API key equal to either would hand it to clients.

Messages name the setting and the problem, never the value.  Standard library only (the compose
entrypoint imports this module).
"""
from __future__ import annotations

from typing import Mapping

from common.cluster.auth import secret_problem

MAKE_ONE = "generate one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"


def read_secret_file(path: str, what: str) -> str:
    """The contents of ``path`` without surrounding whitespace; ValueError naming ``what`` and the
    file (not its contents) when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise ValueError(f"cannot read {what} from the file {path}: {reason}") from None


def secret_from_env(name: str, env: Mapping[str, str], what: str | None = None) -> str | None:
    """``{name}_FILE``'s file when that variable is set, else ``name``; None when neither is (an
    empty variable means unset)."""
    path = env.get(f"{name}_FILE")
    if path:
        return read_secret_file(path, what or name)
    return env.get(name) or None


def check_secret(value: str | None, what: str) -> None:
    """Raise ValueError unless ``value`` is strong enough to be ``what`` (None: not configured, fine)."""
    if value is None:
        return
    problem = secret_problem(value)
    if problem:
        raise ValueError(f"{what} is not acceptable: {problem}; {MAKE_ONE}")


def check_distinct(named: Mapping[str, str | None]) -> None:
    """Raise ValueError when two of the configured secrets in ``named`` ({what: value}) are equal."""
    seen: dict[str, str] = {}
    for what, value in named.items():
        if not value:
            continue
        if value in seen:
            raise ValueError(f"{seen[value]} and {what} are the same value: each must be its own random "
                             f"secret (whoever holds one must not hold the other)")
        seen[value] = what
