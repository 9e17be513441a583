"""Hosts for multi-host tests: one network namespace per host, each with its own ``eth0`` on a
bridge in this (the test's) namespace, which holds the bridge's address so the test reaches every
host.  Processes run in a host with ``ip netns exec`` (``Lab.prefix``), bound to its address.

Faults are made with the kernel, never simulated: ``cut``/``heal`` drop every packet between two
hosts, both ways and silently (``iptables DROP`` on each host's input: established connections
hang and new ones wait for their connect timeouts, as across a dead link; where iptables cannot run
in a namespace, blackhole routes in both hosts, which drop an established connection's packets as
silently but fail a new connection at once), ``limit`` a ``tc tbf`` rate on a host's link,
``link_down``/``link_up`` its interface.  ``Lab`` is a context manager; leaving it (and interpreter exit) removes every
namespace and the bridge, so nothing outlives the test.
"""
from __future__ import annotations

import atexit
import functools
import os
import random
import shutil
import subprocess
import uuid


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a skip reason), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    name = f"pdprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Lab:
    """See the module docstring.  ``hosts``: their names (short words: d0, redis, ...)."""

    def __init__(self, hosts: list[str]):
        self.tag = uuid.uuid4().hex[:5]
        self.bridge = f"pdbr{self.tag}"
        self.net = f"10.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
        self.hosts = {host: (f"pd{self.tag}-{host}", f"{self.net}.{10 + i}") for i, host in enumerate(hosts)}
        self._made: list[str] = []

    def __enter__(self) -> "Lab":
        atexit.register(self.down)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(self.bridge)
            _ip("addr", "add", f"{self.net}.254/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, (host, (ns, address)) in enumerate(self.hosts.items()):
                _ip("netns", "add", ns)
                self._made.append(ns)
                outside, inside = f"pv{self.tag}{i}", f"pi{self.tag}{i}"
                _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
                _ip("link", "set", outside, "master", self.bridge, "up")
                _ip("link", "set", inside, "netns", ns)
                self.run(host, "ip", "link", "set", inside, "name", "eth0")
                self.run(host, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
                self.run(host, "ip", "link", "set", "eth0", "up")
                self.run(host, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def down(self) -> None:
        """Remove every namespace (its veth goes with it) and the bridge; idempotent."""
        for name in reversed(self._made):
            if name == self.bridge:
                subprocess.run(["ip", "link", "del", name], capture_output=True)
            else:
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()

    def address(self, host: str) -> str:
        return self.hosts[host][1]

    def prefix(self, host: str) -> list[str]:
        """Put before a command line to run it in ``host``."""
        return ["ip", "netns", "exec", self.hosts[host][0]]

    def run(self, host: str, *cmd: str) -> str:
        return subprocess.run([*self.prefix(host), *cmd], check=True, capture_output=True, text=True,
                              timeout=30).stdout

    @functools.cached_property
    def has_iptables(self) -> bool:
        """Whether iptables works in the hosts (it needs the binary and netfilter in the kernel)."""
        host = next(iter(self.hosts))
        return shutil.which("iptables") is not None and subprocess.run(
            [*self.prefix(host), "iptables", "-S", "INPUT"], capture_output=True, timeout=30).returncode == 0

    def cut(self, a: str, b: str) -> None:
        """Drop every packet between hosts ``a`` and ``b``, both ways (connections hang, as on a dead link)."""
        self._partition(True, a, b)

    def heal(self, a: str, b: str) -> None:
        self._partition(False, a, b)

    def _partition(self, cut: bool, a: str, b: str) -> None:
        for here, there in ((a, b), (b, a)):
            if self.has_iptables:
                self.run(here, "iptables", "-I" if cut else "-D", "INPUT", "-s", self.address(there), "-j", "DROP")
            else:
                self.run(here, "ip", "route", "add" if cut else "del", "blackhole", f"{self.address(there)}/32")

    def limit(self, host: str, rate: str) -> None:
        """Everything ``host`` sends goes out at ``rate`` (``tc tbf``, e.g. ``"256kbit"``)."""
        self.run(host, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "16kbit",
                 "latency", "5s")

    def unlimit(self, host: str) -> None:
        self.run(host, "tc", "qdisc", "del", "dev", "eth0", "root")

    def link_down(self, host: str) -> None:
        self.run(host, "ip", "link", "set", "eth0", "down")

    def link_up(self, host: str) -> None:
        self.run(host, "ip", "link", "set", "eth0", "up")
