"""A launcher with tiny children instead of the model stack, for the launcher's process tests.

    python tests/support/launcher_parent.py DIR MODE N

Does what ``make up`` does (``launcher.run.run_stack``: stop signals, start-up,
supervision, stop) with a private ``redis-server`` and N ``tests/support/launcher_child.py`` processes in
MODE (drain/stuck), each allowed a long drain (so only a signal or the test ends a stop), plus a
"gateway" child that never answers, so start-up waits for workers until a stop signal.  Writes
``DIR/parent.json`` (its pid, the children's and Redis's) once every child is ready.  Exits 3 when
start-up was stopped (as ``make up`` exits non-zero then).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.cluster.children import StopSignals  # noqa: E402
from launcher.local_stack import LocalStack, StartCancelled, free_port  # noqa: E402
from launcher.run import run_stack  # noqa: E402
from launcher.supervisor import Supervisor  # noqa: E402
from common.cluster.redis_util import start_redis_server  # noqa: E402

CHILD = str(Path(__file__).with_name("launcher_child.py"))
DRAIN_S = 3600.0  # longer than any test waits: a stop ends by the children, or by the third signal


def main() -> None:
    directory, mode, count = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    signals = StopSignals().install()
    redis_server = start_redis_server()
    stack = LocalStack("unused", redis_server.url, workdir=directory)
    names = [f"c{i}" for i in range(count)] + ["gateway"]
    for name in names:
        stack.spawn(name, [sys.executable, CHILD, str(directory), name, mode],
                    f"http://127.0.0.1:{free_port()}", drain_timeout_s=DRAIN_S)
    while not all((directory / f"{name}.ready").exists() for name in names):
        time.sleep(0.02)
    pids = {name: proc.popen.pid for name, proc in stack.procs.items()}
    (directory / "parent.json.tmp").write_text(json.dumps(
        {"parent": os.getpid(), "children": pids, "redis": redis_server.proc.pid}))
    os.replace(directory / "parent.json.tmp", directory / "parent.json")
    try:
        run_stack(stack, redis_server, signals,
                  start=lambda: stack.wait_for_workers(1, 1, timeout=3600, cancelled=lambda: signals.requested),
                  make_supervisor=lambda: Supervisor(stack, redis_server))
    except StartCancelled:
        print("start-up stopped", flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
