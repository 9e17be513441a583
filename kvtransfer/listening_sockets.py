"""The TCP listeners a library opens inside this process, and whether each is still open.

UCX's TCP transport listens on a port of its own for its peers' connections (``ucx_worker``); it
accepts every connection and, when an accept fails for want of descriptors, closes that listener
for good -- with nothing said to its owner.  ``opened_by`` records the listeners a call opened (by
the socket inodes of this process's descriptors, before and after it); ``closed`` names those no
longer open, so a worker whose UCX listener died can say so on ``/health``.

Only listening sockets count, so a connection opened meanwhile is never taken for one; a listener
another thread opened during the call would be (workers open theirs from the event loop, one at a
time).
"""
from __future__ import annotations

import os
from typing import Callable, TypeVar

T = TypeVar("T")
_LISTEN = "0A"  # /proc/net/tcp's state of a listening socket


def _socket_descriptors() -> dict[int, str]:
    """This process's socket descriptors: fd -> inode."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            out[int(name)] = link[len("socket:["):-1]
    return out


def _listening_ports() -> dict[str, int]:
    """Every listening TCP socket of this network namespace: inode -> port."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 9 and fields[3] == _LISTEN:
                        out[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
        except OSError:  # no IPv6 in this kernel
            continue
    return out


class OpenedListeners:
    """The listeners ``opened_by``'s call opened: ``{fd: (inode, port)}``."""

    def __init__(self, sockets: dict[int, tuple[str, int]]):
        self.sockets = sockets

    @property
    def ports(self) -> list[int]:
        return sorted(port for _, port in self.sockets.values())

    def closed(self) -> list[str]:
        """Those no longer open (their descriptor closed, or reused by another socket)."""
        gone = []
        for fd, (inode, port) in self.sockets.items():
            try:
                still = os.readlink(f"/proc/self/fd/{fd}") == f"socket:[{inode}]"
            except OSError:
                still = False
            if not still:
                gone.append(f"port {port}")
        return gone


def opened_by(call: Callable[[], T]) -> tuple[T, OpenedListeners]:
    """``call()``'s result, and the TCP listeners it opened in this process (none where ``/proc``
    cannot be read: nothing is watched then)."""
    try:
        before = set(_socket_descriptors().values())
    except OSError:
        return call(), OpenedListeners({})
    result = call()
    try:
        listening = _listening_ports()
        opened = {fd: (inode, listening[inode]) for fd, inode in _socket_descriptors().items()
                  if inode not in before and inode in listening}
    except OSError:
        opened = {}
    return result, OpenedListeners(opened)
