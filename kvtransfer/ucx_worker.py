"""One UCX context and worker per event loop, driven the way ucxx's own asyncio layer does it.

ucxx's asyncio layer (``ucxx.create_listener``/``create_endpoint``) keeps one global context bound
to the first event loop that used it, and its listener binds every interface. This module uses
ucxx's low-level API instead, so that each event loop gets its own worker (a process may run
several loops one after the other, and tests run under both uvloop and the stdlib loop), and so
that no UCX listener is opened (its sockaddr listener binds every interface): peers learn the
worker's address over an authenticated TCP connection (see ``transport_ucx``).  UCX's TCP transport
still listens on a port of its own for the endpoints peers open to that address; it is watched
(``failed_ucx_listeners``)::

    UCX progress thread (C++, no GIL)  --completes requests-->  request notifier queue
    notifier thread (ours): waits on that queue, then asks the loop to run the notifier
    event loop: run_request_notifier() sets each request's asyncio future -> awaiting coroutine

Workers are shared per ``(loop, UCX options)`` and reference-counted: ``acquire`` / ``release``.

UCX options applied per context (the environment still wins for anything it sets):

* ``POSIX_ERROR_HANDLING``, ``SYSV_ERROR_HANDLING``, ``CMA_MEMORY_INVALIDATE``: our endpoints use
  peer error handling (we need to see a peer die), and without these UCX silently drops every
  shared-memory transport for such endpoints and falls back to TCP over loopback.
* ``RNDV_FRAG_MEM_TYPE=host`` on hosts without CUDA (ucxx defaults it to ``cuda``).
* ``NET_DEVICES``: see ``net_devices_for``; keeps UCX's own TCP sockets on the configured interface.
  (UCX's TCP transport listens on every network device it uses; without this a worker whose KV
  host is 127.0.0.1 would still listen on the machine's external addresses.)
"""
from __future__ import annotations

import asyncio
import atexit
import fcntl
import glob
import ipaddress
import logging
import os
import socket
import struct
import threading
import weakref

from kvtransfer.errors import ConnectionLost, ProtocolError
from kvtransfer.listening_sockets import opened_by

log = logging.getLogger(__name__)

_BASE_OPTIONS = {
    "POSIX_ERROR_HANDLING": "y",
    "SYSV_ERROR_HANDLING": "y",
    "CMA_MEMORY_INVALIDATE": "y",
}
_NOTIFIER_POLL_NS = int(0.5e9)
_CLOSE_PERIOD_NS = int(1e9)

# UCX variables the user set (ucxx's import adds its own defaults to the environment later, e.g.
# RNDV_FRAG_MEM_TYPE=cuda, which our options must still override).
_USER_UCX_ENV = frozenset(k for k in os.environ if k.startswith("UCX_"))

_live: "weakref.WeakSet[UcxWorker]" = weakref.WeakSet()
_shared: dict[tuple, "UcxWorker"] = {}


def ucx_api():
    """ucxx's low-level API (importing it also applies ucxx's environment defaults)."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    from ucxx._lib import libucxx

    return libucxx


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


_SIOCGIFADDR = 0x8915
_IFF_LOOPBACK = 0x8


def _interface_addresses() -> dict[str, set[ipaddress._BaseAddress]]:
    """Each network interface's addresses (Linux: ioctl for IPv4, /proc for IPv6)."""
    found: dict[str, set] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                found.setdefault(name, set()).add(ipaddress.ip_address(packed[20:24]))
            except OSError:
                found.setdefault(name, set())
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                found.setdefault(fields[-1], set()).add(ipaddress.ip_address(bytes.fromhex(fields[0])))
    except OSError:
        pass
    return found


def _is_loopback_interface(name: str) -> bool:
    try:
        with open(f"/sys/class/net/{name}/flags") as f:
            return bool(int(f.read(), 16) & _IFF_LOOPBACK)
    except (OSError, ValueError):
        return name == "lo"


def _rdma_devices() -> list[str]:
    """``mlx5_0:1``-style names of the RDMA ports (they open no TCP listener)."""
    return sorted(f"{port.split('/')[-3]}:{port.split('/')[-1]}"
                  for port in glob.glob("/sys/class/infiniband/*/ports/*"))


def net_devices_for(host: str) -> str | None:
    """``UCX_NET_DEVICES`` for a worker whose KV listener binds ``host``: the interface holding
    that address (plus the RDMA ports, which listen on nothing), so UCX's own TCP listeners sit
    where the configured one does. None (UCX's default: every device) for a wildcard host, or
    when no interface holds the address (e.g. a name that does not resolve here)."""
    try:
        ip = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0].split("%")[0])
    except (OSError, ValueError, IndexError):
        return None
    if ip.is_unspecified:
        return None
    interfaces = _interface_addresses()
    if ip.is_loopback:
        names = [n for n in interfaces if _is_loopback_interface(n)]
        return names[0] if names else None
    holder = next((name for name, addresses in interfaces.items() if ip in addresses), None)
    if holder is None:
        log.warning("no network interface holds the KV host %s; UCX keeps its default devices", host)
        return None
    return ",".join([holder, *_rdma_devices()])


def ucx_options(net_devices: str | None) -> dict[str, str]:
    """The UCX options a context gets; ``UCX_<NAME>`` set by the user overrides any of them."""
    options = dict(_BASE_OPTIONS)
    if not _cuda_available():
        options["RNDV_FRAG_MEM_TYPE"] = "host"
    if net_devices:
        options["NET_DEVICES"] = net_devices
    return {k: v for k, v in options.items() if f"UCX_{k}" not in _USER_UCX_ENV}


class UcxWorker:
    """A UCX context + worker with its progress and notifier threads, for one event loop."""

    @classmethod
    def acquire(cls, net_devices: str | None = None) -> "UcxWorker":
        loop = asyncio.get_running_loop()
        options = ucx_options(net_devices)
        key = (id(loop), tuple(sorted(options.items())))
        worker = _shared.get(key)
        if worker is None or worker._closed or worker.loop is not loop:
            worker = cls(loop, options)
            _shared[key] = worker
            worker._key = key
        worker._refs += 1
        return worker

    def release(self) -> None:
        self._refs -= 1
        if self._refs <= 0:
            if _shared.get(self._key) is self:
                del _shared[self._key]
            self.close()

    def __init__(self, loop: asyncio.AbstractEventLoop, options: dict[str, str]):
        api = ucx_api()
        self.api = api
        self.loop = loop
        self.options = options
        self._key: tuple = ()
        self._refs = 0
        self._closed = False
        # Receives a frozen sender left landing, and their buffers (kvtransfer.transport_ucx): kept
        # until they end -- UCX writes into the buffers till then -- or this worker closes.
        self.still_landing: dict[asyncio.Future, object] = {}
        # UCX's TCP transport listens for its peers (on NET_DEVICES' interface), without bounds or
        # authentication of its own; past the descriptor limit it closes that listener for good.
        (self.context, self.worker), self.tcp_listeners = opened_by(lambda: self._context_and_worker(api, options))
        if _cuda_available():
            from ucxx._cuda_context import ensure_cuda_context

            # The progress thread moves device memory: it needs the CUDA context current.
            self.worker.set_progress_thread_start_callback(ensure_cuda_context, cb_args=(0,))
        self.worker.start_progress_thread(polling_mode=False, epoll_timeout=1)
        self.address = bytes(self.worker.address.tobytes())
        log.info("UCX %s worker started (options %s; its TCP listeners: ports %s)",
                 ".".join(map(str, api.get_ucx_version())), options, self.tcp_listeners.ports)
        self._stop = threading.Event()
        self._notifier = threading.Thread(target=self._notify, name="kv-ucx-notifier", daemon=True)
        self._notifier.start()
        _live.add(self)

    @staticmethod
    def _context_and_worker(api, options: dict[str, str]):
        context = api.UCXContext(options, feature_flags=(api.Feature.TAG, api.Feature.WAKEUP))
        return context, api.UCXWorker(context, enable_delayed_submission=False, enable_python_future=True)

    # -- requests ----------------------------------------------------------------------------

    def tag(self, value: int):
        return self.api.UCXXTag(value)

    def array(self, buffer):
        from ucxx._lib.arr import Array

        return Array(buffer)

    async def wait(self, future: asyncio.Future) -> None:
        """Wait for a request's future without ever cancelling it (ucxx owns it); UCX errors
        become ``ConnectionLost`` (``ProtocolError`` for a message larger than its buffer)."""
        await asyncio.wait((future,))
        error = future.exception()
        if error is None:
            return
        if isinstance(error, self.api.UCXMessageTruncatedError):
            raise ProtocolError("ucx payload longer than the announced size") from None
        if isinstance(error, self.api.UCXCanceledError):
            raise ConnectionLost("ucx request cancelled (connection closed)") from None
        raise ConnectionLost(f"ucx request failed: {type(error).__name__}: {error}") from None

    def is_cancelled(self, future: asyncio.Future) -> bool:
        return future.done() and isinstance(future.exception(), self.api.UCXCanceledError)

    def connect(self, address: bytes):
        """An endpoint to the worker at ``address`` (peer error handling on)."""
        api = self.api
        return self.worker.create_endpoint_from_worker_address(api.UCXAddress.create_from_buffer(address), True)

    def close_endpoint(self, ep) -> None:
        """Cancel the endpoint's requests (their futures fail) and close it; bounded."""
        try:
            ep.close_blocking(_CLOSE_PERIOD_NS, 1)
        except self.api.UCXError as exc:
            log.debug("ucx endpoint close: %r", exc)

    # -- lifecycle ---------------------------------------------------------------------------

    def _notify(self) -> None:
        asyncio.set_event_loop(self.loop)  # python futures are created for this loop
        ready = self.api.PythonRequestNotifierWaitState.Ready
        shutdown = self.api.PythonRequestNotifierWaitState.Shutdown
        while not self._stop.is_set():
            self.worker.populate_python_futures_pool()
            state = self.worker.wait_request_notifier(period_ns=_NOTIFIER_POLL_NS)
            if state == shutdown:
                break
            if state != ready:
                continue
            ran = threading.Event()
            try:
                self.loop.call_soon_threadsafe(self._run_notifier, ran)
            except RuntimeError:  # the loop is closed
                break
            while not ran.wait(0.1):
                if self._stop.is_set() or self.loop.is_closed():
                    return

    def _run_notifier(self, ran: threading.Event) -> None:
        try:
            if not self._closed:
                self.worker.run_request_notifier()
        finally:
            ran.set()

    def close(self) -> None:
        """Stop the threads and drop the worker (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        try:
            self.worker.stop_request_notifier_thread()
        except Exception as exc:  # best effort at shutdown
            log.debug("ucx notifier stop: %r", exc)
        if threading.current_thread() is not self._notifier:
            self._notifier.join(timeout=5)
        self.worker.stop_progress_thread()
        self.worker.clear_python_futures_pool()
        self.still_landing.clear()  # (its progress thread stopped: nothing lands any more)


def failed_ucx_listeners() -> list[str]:
    """The TCP listeners of this process's open UCX workers that UCX has closed: a worker with one
    of these takes no new UCX connection (senders fall back, or fail) and must not report itself
    healthy."""
    return [f"ucx tcp listener {gone}" for worker in list(_live) if not worker._closed
            for gone in worker.tcp_listeners.closed()]


@atexit.register
def _close_all() -> None:
    # The progress thread is a C++ thread: left running, it aborts the interpreter at exit.
    for worker in list(_live):
        worker.close()
