"""The gateway's admin API as pdctl calls it: ``AdminClient`` (bearer token, bounded waits) and
``AdminError``, what every subcommand that talks to a deployment raises when it is refused."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from common.cluster.direct_http import urlopen


class AdminError(Exception):
    """The gateway (or the worker behind it) said no, or could not be reached."""


class AdminClient:
    """The gateway's admin endpoints, over plain HTTP."""

    def __init__(self, url: str, token: str | None, timeout: float = 15.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["X-Admin-Token"] = self.token
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raise AdminError(f"{method} {path}: HTTP {exc.code}: {_error_message(exc.read())}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise AdminError(f"cannot reach the gateway at {self.url}: {reason}") from None

    def pools(self) -> dict:
        return self._call("GET", "/admin/pools")

    def workers(self) -> list[dict]:
        return self.pools()["workers"]

    def steps(self, worker_id: str, since: float, limit: int = 4096) -> dict:
        """One page of a worker's step log (``pdctl.planner.live``)."""
        return self._call("GET", f"/admin/workers/{_quote(worker_id)}/steps?since={since!r}&limit={int(limit)}")

    def drain(self, worker_id: str) -> dict:
        return self._call("POST", f"/admin/workers/{_quote(worker_id)}/drain", {})

    def set_role(self, worker_id: str, role: str) -> dict:
        return self._call("POST", f"/admin/workers/{_quote(worker_id)}/role", {"role": role})

    def last_heartbeat(self, worker_id: str) -> float:
        """The worker's ``heartbeat_at`` now (its own clock), or 0.0 if it is not registered."""
        entry = next((w for w in self.workers() if w["worker_id"] == worker_id), None)
        return entry.get("heartbeat_at", 0.0) if entry else 0.0

    def wait_for(self, worker_id: str, done, what: str, timeout: float, after: float = 0.0) -> dict:
        """Poll the pools until ``done(entry)`` holds for the worker in an entry written after
        ``after`` (a ``heartbeat_at`` read before the change: the worker's clock, so no skew with
        this host's).  Raises AdminError on timeout."""
        deadline = time.monotonic() + timeout
        entry = None
        while True:
            entry = next((w for w in self.workers() if w["worker_id"] == worker_id), None)
            if entry is not None and entry.get("heartbeat_at", 0) > after and done(entry):
                return entry
            if time.monotonic() > deadline:
                state = "gone from the registry" if entry is None else f"{entry['role']}/{entry['state']}"
                raise AdminError(f"worker {worker_id} did not become {what} within {timeout:g}s (now {state})")
            time.sleep(0.25)


def _quote(worker_id: str) -> str:
    from urllib.parse import quote

    return quote(worker_id, safe="")


def _error_message(raw: bytes) -> str:
    """The message of an OpenAI-shaped error from the gateway or a plain one from a worker."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500] or "(empty body)"
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message"))
    return str(error if error is not None else body)
