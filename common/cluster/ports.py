"""A free TCP port on loopback, for a listener chosen at start-up."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (another process may take it before it is bound: callers bind soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
