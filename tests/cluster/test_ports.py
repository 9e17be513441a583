"""``free_port``: a bindable loopback port outside the kernel's ephemeral range, never handed out twice."""
from __future__ import annotations

import socket

from common.cluster import ports


def test_ports_are_outside_the_ephemeral_range_bindable_and_distinct():
    low, high = ports.ephemeral_range()
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == len(picked)
    for port in picked:
        assert not low <= port <= high, (port, low, high)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_someone_holds_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (65000, 65100))
        with socket.socket() as released:
            released.bind(("127.0.0.1", 0))
            free = released.getsockname()[1]
        draws = iter([taken, free])
        monkeypatch.setattr(ports._random, "randint", lambda first, last: next(draws))
        assert ports.free_port() == free


def test_with_no_room_outside_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    port = ports.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
