"""Entry point shared by ``python -m prefill_svc`` and ``python -m decode_svc``."""
from __future__ import annotations

from common.engine import compute_process

# Before torch loads its OpenMP runtime (the imports below) and before any other thread starts:
# OpenMP threads that spin briefly between parallel regions, then sleep -- they share the cores
# with this process's HTTP loop and, on a shared host, with other work -- and one malloc arena
# that keeps freed activations for the next step (see the module).
compute_process.configure()

import asyncio  # noqa: E402
import os  # noqa: E402
import importlib  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

from common.cluster.aio import run_service  # noqa: E402
from worker.config import build_parser, config_from_args  # noqa: E402
from worker.role_context import RoleModule  # noqa: E402
from worker.lifecycle import Worker  # noqa: E402

log = logging.getLogger(__name__)

# The role modules every worker hosts, so that its role can change without a restart: by import
# path, loaded when the worker starts (the service packages import the worker, never the reverse).
ROLE_MODULES = ("prefill_svc.role:PREFILL", "decode_svc.role:DECODE")

# Beyond --failure-drain-timeout, how long a worker whose engine failed may take to stop (listeners,
# registry, transports) before it exits regardless.
FAILURE_EXIT_GRACE_S = 15.0


def exit_now(status: int) -> None:
    """End the process at once with ``status``, stdout and stderr flushed.  For a worker whose
    engine failed: its engine thread may never return, nor a thread of the event loop's default
    executor waiting on the device (``kvtransfer.ordering.wait_for_fence`` on a hung kernel), and
    the interpreter's shutdown -- ``asyncio.run``'s first -- would wait for them forever."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def exit_later(seconds: float, status: int) -> threading.Timer:
    """``exit_now(status)`` from a daemon timer ``seconds`` from now (the bound on an orderly exit)."""
    timer = threading.Timer(seconds, exit_now, (status,))
    timer.daemon = True
    timer.start()
    return timer


async def serve(config, modules) -> int:
    """Run a worker until SIGINT/SIGTERM, then drain (bounded by ``drain_timeout_s``) and stop, so a
    restart or a compose scale-down does not cut the streams in flight.  Returns the exit status:
    0 -- or, when the engine failed, never: after at most ``failure_drain_timeout_s`` for the
    requests in flight to get their errors the worker stops and the process exits with status 1
    (``exit_now``), within ``FAILURE_EXIT_GRACE_S`` more even if stopping hangs, so the supervisor
    restarts it."""
    drain_timeout, failure_drain_timeout = config.drain_timeout_s, config.failure_drain_timeout_s
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
            exit_later(failure_drain_timeout + FAILURE_EXIT_GRACE_S, 1)
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
        if worker.failure is not None:
            exit_later(FAILURE_EXIT_GRACE_S, 1)  # (also when the engine failed during a drain)
        await worker.stop()
        if worker.failure is not None:
            exit_now(1)  # not through asyncio.run's shutdown: see exit_now


def load_role_modules(paths: tuple[str, ...] = ROLE_MODULES) -> list[RoleModule]:
    """The ``RoleModule`` objects named ``"package.module:NAME"``."""
    modules = []
    for path in paths:
        module_name, _, name = path.partition(":")
        modules.append(getattr(importlib.import_module(module_name), name))
    return modules


def main(default_role: str, description: str) -> None:
    """Parse flags and run a worker hosting every role module (``ROLE_MODULES``)."""
    modules = load_role_modules()
    try:
        args = build_parser(default_role, description).parse_args()
    except ValueError as exc:  # a PDSERVE_* variable that is not valid
        raise SystemExit(f"error: {exc}") from None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    sys.exit(run_service(serve(config, modules)))
