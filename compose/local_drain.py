"""``entrypoint.py --drain``: drain the worker of this container before it stops (a Kubernetes
``preStop`` hook, or an operator's ``docker exec``).

The worker takes signed admin calls only: this signs ``POST /admin/drain`` with the cluster
secret the container already holds, for the worker's current run (its ``/health`` names it), then
waits until the worker reports ``idle``.  A drain hands the worker's streams over to other decode
workers at a token boundary (stream migration), so it takes about one step, not the longest
stream.  Exit 0 once idle; 1 when the worker cannot be reached or is still busy at ``timeout``
(the container's own SIGTERM drain then goes on, bounded by ``PDSERVE_DRAIN_TIMEOUT``).
"""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Mapping

from common.cluster.auth import SECRET_ENV, ClusterAuth, audience_of
from common.cluster.direct_http import urlopen  # (a local worker: never through the pod's http_proxy)
from common.cluster.secret_sources import secret_from_env

POLL_S = 0.5


def _get_json(url: str, timeout: float = 5.0) -> dict:
    with urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def drain(runtime_file: Path, env: Mapping[str, str], timeout: float) -> int:
    try:
        runtime = json.loads(runtime_file.read_text())
        health_url, worker_id = runtime["health_url"], runtime["worker_id"]
    except (OSError, ValueError, KeyError):
        print(f"drain: no worker runtime file at {runtime_file} (not a worker container?)", file=sys.stderr)
        return 1
    base = health_url.rsplit("/health", 1)[0]
    deadline = time.monotonic() + timeout
    try:
        instance = _get_json(health_url)["instance"]
        auth = ClusterAuth(secret_from_env(SECRET_ENV, env, "the cluster secret"))
        body = b"{}"
        headers = {"Content-Type": "application/json",
                   **auth.sign_request("POST", "/admin/drain", body, audience=audience_of(worker_id, instance))}
        request = urllib.request.Request(base + "/admin/drain", data=body, method="POST", headers=headers)
        with urlopen(request, timeout=10):
            pass
        while True:
            state = _get_json(health_url).get("state")
            if state == "idle":
                print(f"drain: {worker_id} is idle", flush=True)
                return 0
            if time.monotonic() >= deadline:
                print(f"drain: {worker_id} still {state} after {timeout:g} s", file=sys.stderr)
                return 1
            time.sleep(POLL_S)
    except (OSError, ValueError, KeyError) as exc:
        print(f"drain: {worker_id}: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str]) -> int:
    """``--drain [SECONDS]`` (default: ``PDSERVE_DRAIN_TIMEOUT`` or 120)."""
    timeout = float(argv[0]) if argv else float(os.environ.get("PDSERVE_DRAIN_TIMEOUT") or 120)
    runtime_file = Path(os.environ.get("PDSERVE_RUNTIME_FILE", "/tmp/pdserve-runtime.json"))
    return drain(runtime_file, os.environ, timeout)
