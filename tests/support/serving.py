"""What the serving tests share: the workers' settings of their stacks, and waiting for a worker
to run nothing with every block free."""
from __future__ import annotations

import time

BLOCK_SIZE = 4
WORKER_ARGS = ["--num-blocks", "512", "--block-size", str(BLOCK_SIZE), "--max-num-batched-tokens", "16"]


def wait_idle(stack, worker: str, timeout: float = 120.0) -> dict:
    """Poll until the worker runs nothing and every block is free again (the bound only turns a
    hang into a failure; a loaded machine may take a while)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = stack.stats(worker)
        if stats["inflight"] == 0 and stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"{worker} still busy: {stats}")
        time.sleep(0.05)
