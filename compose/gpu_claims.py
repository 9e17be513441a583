"""Slots of a host for its workers: one GPU (or CPU set) each, or N GPUs at once for a
tensor-parallel worker, locked with ``flock`` on files in a directory every worker container of
the host mounts (``compose/entrypoint.py`` explains the whole claim).  Standard library only."""
from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from net_devices import Refusal


class Surplus(Exception):
    """Every GPU (or CPU set) of this host is taken: this replica has nothing to run on."""


def _try_lock(lock_dir: Path, kind: str, item: str) -> int | None:
    fd = os.open(lock_dir / f"{kind}-{item.replace(',', '_')}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode())
    return fd


def claim(items: list[str], lock_dir: Path, kind: str, count: int = 1) -> tuple[list[int], list[int]]:
    """Lock ``count`` free items, all or none; returns (their slots, the descriptors holding the
    locks).  An aligned group of slots (``count``-sized, starting at a multiple of it) is taken
    before a scattered one.  Raises Surplus when fewer than ``count`` are free."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    mutex = os.open(lock_dir / f"{kind}-claim.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(mutex, fcntl.LOCK_EX)  # one claimer at a time: two half-claims never starve each other
        held: dict[int, int] = {}
        for slot, item in enumerate(items):
            fd = _try_lock(lock_dir, kind, item)
            if fd is not None:
                held[slot] = fd
        aligned = [list(range(first, first + count)) for first in range(0, len(items) - count + 1, count)]
        chosen = next((group for group in aligned if all(s in held for s in group)), sorted(held)[:count])
        for slot in [s for s in held if s not in chosen]:
            os.close(held.pop(slot))
        if len(chosen) < count:
            for fd in held.values():
                os.close(fd)
            raise Surplus(f"{len(held)} of this host's {kind}s ({', '.join(items)}) are free (locks in {lock_dir}), "
                          f"this worker needs {count}; this replica is surplus and exits. Scale the services to "
                          f"what the host holds (`pdctl scale`, `pdctl plan`).")
        return chosen, [held[s] for s in chosen]
    finally:
        os.close(mutex)


def tensor_parallel_size(env: dict[str, str], gpus: list[str]) -> int:
    text = (env.get("PDSERVE_TENSOR_PARALLEL_SIZE") or "1").strip()
    if not text.isdigit() or int(text) < 1:
        raise Refusal(f"PDSERVE_TENSOR_PARALLEL_SIZE={text!r}: a positive number of GPUs per worker")
    if int(text) > len(gpus):
        raise Refusal(f"PDSERVE_TENSOR_PARALLEL_SIZE={text} but PDSERVE_GPUS gives this host's workers "
                      f"{len(gpus)} GPU(s) ({','.join(gpus)})")
    return int(text)


def visible_devices(gpus: list[str], slots: list[int], isolate: bool) -> str:
    claimed = [gpus[s] for s in slots]
    return ",".join(claimed if isolate else claimed + [g for g in gpus if g not in claimed])
