"""Entry point shared by ``python -m prefill_svc`` and ``python -m decode_svc``."""
from __future__ import annotations

import os

# Set before torch loads its OpenMP runtime (the imports below): OpenMP threads that sleep at a
# barrier rather than spin.  The engine's threads share the cores with this process's HTTP loop
# (and, on a shared host, with other work); spinning threads then wait on descheduled ones -- a
# decode step was ~5x slower with 2 spinning threads than with 1 on a busy 2-core machine, ~1.4x
# with passive ones.  OMP_WAIT_POLICY=ACTIVE in the environment restores spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import asyncio  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

from common.cluster.aio import run_service  # noqa: E402
from common.worker.config import build_parser, config_from_args  # noqa: E402
from common.worker.roles import RoleModule  # noqa: E402
from common.worker.server import Worker  # noqa: E402

log = logging.getLogger(__name__)


async def serve(config, modules, drain_timeout: float = 30.0, failure_drain_timeout: float = 5.0) -> int:
    """Run a worker until SIGINT/SIGTERM, then drain (bounded by ``drain_timeout``) and stop, so a
    restart or a compose scale-down does not cut the streams in flight.  Returns the exit status:
    0, or 1 when the engine failed (after at most ``failure_drain_timeout`` for the requests in
    flight to get their errors), so the supervisor restarts the process."""
    worker = Worker(config, modules)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await worker.start()
    print(f"worker {config.worker_id} ({worker.role}) ready at {worker.http_url}", flush=True)
    try:
        stopped, failed = asyncio.ensure_future(stop.wait()), asyncio.ensure_future(worker.failed.wait())
        await asyncio.wait([stopped, failed], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        failed.cancel()
        if worker.failure is not None:
            log.error("the engine failed: exiting with status 1 once in-flight requests have their errors")
            await worker.wait_idle(failure_drain_timeout)
            return 1
        log.info("draining before shutdown (at most %.0f s; a second signal stops at once)", drain_timeout)
        stop.clear()
        waiters = [asyncio.ensure_future(worker.drain()), asyncio.ensure_future(stop.wait())]
        await asyncio.wait(waiters, timeout=drain_timeout, return_when=asyncio.FIRST_COMPLETED)
        for waiter in waiters:
            waiter.cancel()
        return 0
    finally:
        log.info("shutting down")
        await worker.stop()


def main(default_role: str, description: str, modules: list[RoleModule]) -> None:
    """Parse flags and run a worker hosting ``modules`` (the services' role modules)."""
    try:
        args = build_parser(default_role, description).parse_args()
    except ValueError as exc:  # a PDSERVE_* variable that is not valid
        raise SystemExit(f"error: {exc}") from None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    status = run_service(serve(config, modules, args.drain_timeout, args.failure_drain_timeout))
    if status:
        # The engine failed, perhaps hung: its thread may never return, and the interpreter's
        # shutdown could wait on whatever it holds.  Everything else is closed by now: leave.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
