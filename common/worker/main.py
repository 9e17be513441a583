"""Entry point shared by ``python -m prefill_svc`` and ``python -m decode_svc``."""
from __future__ import annotations

import asyncio
import logging
import signal

from common.worker.config import build_parser, config_from_args
from common.worker.server import Worker


async def serve(config, ready_file: str | None = None) -> None:
    worker = Worker(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await worker.start()
    print(f"worker {config.worker_id} ({worker.role}) ready at {worker.http_url}", flush=True)
    try:
        await stop.wait()
    finally:
        logging.getLogger(__name__).info("shutting down")
        await worker.stop()


def main(default_role: str, description: str) -> None:
    args = build_parser(default_role, description).parse_args()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(config))
