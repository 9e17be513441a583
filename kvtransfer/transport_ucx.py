"""UCX transport through ucxx: UCX picks shared memory, TCP, RDMA or CUDA IPC by itself.

Frames are UCX tag messages on the endpoint's own tags, so they stay in order: a header message
(``u32 len | header``, received into a fixed ``4 + MAX_HEADER_BYTES`` buffer: a longer one is a
truncation error, never an allocation) then the payload message, received straight into the
destination cache region (host or device memory). Payloads above the rendezvous threshold move
zero-copy (CMA ``process_vm_readv`` between processes on one host, RDMA or CUDA IPC elsewhere).

Tuning, applied as defaults before ucxx is imported (the environment still wins):

* ``UCX_POSIX_ERROR_HANDLING=y``, ``UCX_SYSV_ERROR_HANDLING=y``, ``UCX_CMA_MEMORY_INVALIDATE=y``:
  endpoints from a UCX listener always use peer error handling (we need it to see a peer die),
  and without these UCX silently drops every shared-memory transport for such endpoints and
  falls back to TCP over loopback (~1 GB/s here).
* ``UCXPY_ENABLE_PYTHON_FUTURE=1``: completions wake the event loop through a notifier thread
  instead of the loop polling each request, which on a 2-core host halves the bandwidth.
* ``UCX_RNDV_FRAG_MEM_TYPE=host`` on hosts without CUDA (ucxx defaults it to ``cuda``).
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import re
import struct
import threading
from typing import Awaitable, Callable

import numpy as np
import torch

from kvtransfer.errors import ConnectionLost, ProtocolError
from kvtransfer.messages import MAX_HEADER_BYTES
from kvtransfer.transport_base import Channel, Listener, Transport

log = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
UCX_DEFAULTS = {
    "UCX_POSIX_ERROR_HANDLING": "y",
    "UCX_SYSV_ERROR_HANDLING": "y",
    "UCX_CMA_MEMORY_INVALIDATE": "y",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCXPY_ENABLE_PYTHON_FUTURE": "1",
}


_exit_hook_registered = False


def import_ucxx():
    """Import ucxx with our defaults in the environment (they must be set before UCX starts)."""
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if not torch.cuda.is_available():
        os.environ.setdefault("UCX_RNDV_FRAG_MEM_TYPE", "host")
    import ucxx

    global _exit_hook_registered
    if not _exit_hook_registered and os.environ.get("UCXPY_ENABLE_PYTHON_FUTURE") != "0":
        # ucxx's notifier thread is not a daemon and would block interpreter exit forever; stop it
        # in the hook that runs before non-daemon threads are joined (what concurrent.futures uses).
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(ucxx.stop_notifier_thread)
        _exit_hook_registered = True
    return ucxx


def ucx_settings() -> dict[str, str]:
    """The UCX/ucxx environment in effect, for logs and benchmark output."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("UCX_", "UCXPY_"))}


def endpoint_lanes(ep) -> list[str]:
    """The transports UCX chose for an endpoint, e.g. ``["sysv/memory(am)", "cma/memory(rma_bw)"]``.

    Read from ``ucp_ep_print_info`` (ucxx has no Python API for it); ``[]`` if unavailable.
    """
    try:
        import libucx

        ucp = ctypes.CDLL(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so.0"))
        libc = ctypes.CDLL(None)
        libc.tmpfile.restype = ctypes.c_void_p
        for fn in (libc.fflush, libc.rewind, libc.fileno, libc.fclose):
            fn.argtypes = [ctypes.c_void_p]
        stream = libc.tmpfile()
        ucp.ucp_ep_print_info(ctypes.c_void_p(ep.ucp_endpoint), ctypes.c_void_p(stream))
        libc.fflush(stream)
        libc.rewind(stream)
        with os.fdopen(os.dup(libc.fileno(stream)), "r") as f:
            text = f.read()
        libc.fclose(stream)
    except Exception as exc:  # diagnostics only; never fail a connection over them
        log.debug("cannot read UCX endpoint info: %r", exc)
        return []
    lanes = []
    for line in text.splitlines():
        m = re.search(r"lane\[\d+\]:\s+\d+:(\S+?)(?:\.\d+)?\s.*?seg \d+\s*(.*)$", line)
        if m:
            lanes.append(f"{m.group(1)}({','.join(m.group(2).split())})")
    return lanes


def _array(region: torch.Tensor):
    # ucxx takes the buffer protocol (host) or __cuda_array_interface__ (device tensors).
    return region.numpy() if region.device.type == "cpu" else region


class UcxChannel(Channel):
    """One ucxx endpoint carrying frames in both directions."""

    def __init__(self, ep, ucxx):
        self._ep = ep
        self._ucxx = ucxx
        self._send_lock = asyncio.Lock()
        self._header_buf = np.zeros(_LEN.size + MAX_HEADER_BYTES, dtype=np.uint8)
        self._last_len = 0
        self._closed = False
        self.lanes = endpoint_lanes(ep)

    @property
    def description(self) -> str:
        return "ucx " + (" ".join(self.lanes) or "(lanes unknown)")

    def _lost(self, exc: BaseException) -> ConnectionLost:
        return ConnectionLost(f"ucx endpoint failed: {type(exc).__name__}: {exc}")

    async def send(self, header: bytes, payload: torch.Tensor | None = None) -> None:
        async with self._send_lock:
            if self._closed:
                raise ConnectionLost("ucx channel closed")
            try:
                await self._ep.send(np.frombuffer(_LEN.pack(len(header)) + header, dtype=np.uint8))
                if payload is not None:
                    await self._ep.send(_array(payload))
            except self._ucxx.exceptions.UCXError as exc:
                raise self._lost(exc) from None

    async def _recv(self, buf) -> None:
        if self._closed:
            raise ConnectionLost("ucx channel closed")
        try:
            await self._ep.recv(buf)
        except self._ucxx.exceptions.UCXMessageTruncatedError:
            raise ProtocolError("ucx message longer than the announced/allowed size") from None
        except self._ucxx.exceptions.UCXError as exc:
            raise self._lost(exc) from None

    async def recv_header(self) -> bytes:
        # Clear what the previous header left, so a short message can never reuse stale bytes.
        self._header_buf[: self._last_len] = 0
        await self._recv(self._header_buf)
        (length,) = _LEN.unpack(self._header_buf[: _LEN.size].tobytes())
        if not 0 < length <= MAX_HEADER_BYTES:
            raise ProtocolError(f"frame announces a {length}-byte header (limit {MAX_HEADER_BYTES})")
        self._last_len = _LEN.size + length
        return self._header_buf[_LEN.size : self._last_len].tobytes()

    async def recv_payload_into(self, region: torch.Tensor) -> None:
        await self._recv(_array(region))

    async def discard_payload(self, nbytes: int) -> None:
        # A receive into one byte consumes the whole message as "truncated" without moving it.
        try:
            await self._recv(np.zeros(1, dtype=np.uint8))
        except ProtocolError:
            pass

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._ep.abort()


class _UcxListener(Listener):
    def __init__(self, listener, host: str):
        self._listener = listener
        self.address = f"{host}:{listener.port}"

    def close(self) -> None:
        self._listener.close()


class UcxTransport(Transport):
    """UCX through ucxx; ``transport="ucx"``. Logs the transports UCX picked per connection."""

    name = "ucx"

    def __init__(self) -> None:
        self._ucxx = import_ucxx()
        self._logged = False

    def _log_lanes(self, channel: UcxChannel, role: str) -> None:
        level = logging.INFO if not self._logged else logging.DEBUG
        self._logged = True
        log.log(level, "UCX %s endpoint uses %s (UCX %s; settings %s)", role, channel.lanes,
                self._ucxx.get_ucx_version(), ucx_settings())

    async def listen(self, host: str, port: int, on_channel: Callable[[Channel], Awaitable[None]]) -> Listener:
        async def accepted(ep) -> None:
            channel = UcxChannel(ep, self._ucxx)
            self._log_lanes(channel, "server")
            await on_channel(channel)

        return _UcxListener(self._ucxx.create_listener(accepted, port=port), host)

    async def connect(self, host: str, port: int, timeout: float) -> Channel:
        try:
            ep = await asyncio.wait_for(
                self._ucxx.create_endpoint(host, port, connect_timeout=timeout), timeout
            )
        except (self._ucxx.exceptions.UCXError, asyncio.TimeoutError, OSError) as exc:
            raise ConnectionLost(f"cannot connect to {host}:{port} over ucx: {exc!r}") from None
        channel = UcxChannel(ep, self._ucxx)
        self._log_lanes(channel, "client")
        return channel
