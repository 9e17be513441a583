"""A free TCP port on loopback, for a listener chosen at start-up.

The port is picked below the kernel's ephemeral range: a port the kernel hands out itself (to any
process's outgoing connection, or to a listener bound to port 0) could be taken by someone else in
the seconds between the pick and the listener's bind, and a process that starts a service on it
then fails with "address already in use".  Ports below that range are only ever taken by an explicit
bind, and the pick checks that none holds this one now.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default ephemeral range, where the file cannot be read.
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)
# The lowest port picked: below it live well-known and registered services (Redis's 6379, ...).
LOWEST_PICKED_PORT = 10000
# How many ports this process handed out lately are never handed out again (the listener may not
# be bound yet, so a second pick would see the port free).
RECENT_PICKS = 512

_random = random.SystemRandom()
_recent: list[int] = []


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of automatically assigned local ports (inclusive)."""
    try:
        low, high = (int(part) for part in EPHEMERAL_RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing is bound to now, outside the kernel's ephemeral range where there is room
    for one (the caller binds it soon: another explicit bind could still take it first)."""
    low, high = ephemeral_range()
    candidates = [(LOWEST_PICKED_PORT, low - 1)] if low - 1 > LOWEST_PICKED_PORT else []
    if high < 65535:
        candidates.append((high + 1, 65535))
    for _ in range(256 if candidates else 0):
        first, last = _random.choice(candidates)
        port = _random.randint(first, last)
        if port not in _recent and _bindable(port):
            break
    else:  # no room outside the ephemeral range: the kernel's pick
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    _recent.append(port)
    del _recent[:-RECENT_PICKS]
    return port
