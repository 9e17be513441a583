"""What a stranger can make a KV listener hold before authenticating, and what stops it accepting.

* The accept loop survives a full descriptor table (a real one: the process's limit lowered
  under it) and the other errors ``accept`` reports, and keeps accepting afterwards.
* An accept loop that ends anyway is reported (``failed_listeners``), which fails the worker's
  ``/health`` (tests/worker/test_worker_kv_health.py).
* At most ``max_handshakes`` unauthenticated connections are held: beyond, the oldest is closed.
* Before authentication no header longer than ``PREAUTH_MAX_HEADER_BYTES`` is read or buffered.
* Connections that end before authenticating are counted and logged at most one warning a period,
  not a line each (a stranger could fill the log).
"""
from __future__ import annotations

import asyncio
import errno
import os
import resource
import socket
import struct
import sys
from pathlib import Path

import pytest
import torch

from kvt_support import AUTH, LAYOUT, NUM_BLOCKS, random_cache, wait_until
from common.engine.kv.kv_cache import KVCache
from kvtransfer import KVReceiver, KVSender, KVTransferConfig
from kvtransfer.config import parse_address
from kvtransfer.handshake import PREAUTH_MAX_HEADER_BYTES
from kvtransfer.socket_io import failed_listeners
from kvtransfer.transport_tcp import TcpChannel
from tests.support.spawned import SpawnedProcess

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow(seconds=10)]  # one UCX worker per loop, as in the other files

BOUND = 60.0
# Raw connections stay unauthenticated for as long as a test needs: the handshake deadline is
# far beyond any wait here, so only the pre-authentication bound can close them.
PATIENT = dict(connect_timeout=600.0)


async def start_receiver(transport: str, **config) -> KVReceiver:
    receiver = KVReceiver(KVCache(LAYOUT, NUM_BLOCKS), KVTransferConfig(transport=transport, **config), auth=AUTH)
    await receiver.start()
    return receiver


async def transfer_completes(receiver: KVReceiver) -> None:
    """A genuine sender connects, authenticates and lands a block: the listener still accepts."""
    sender = KVSender(random_cache(1), KVTransferConfig(transport=receiver.config.transport), auth=AUTH)
    try:
        rx = receiver.expect("probe", [3])
        tx = await asyncio.wait_for(sender.begin(rx.transfer_id, receiver.address), BOUND)
        await tx.send_blocks([5], [3])
        await asyncio.wait_for(tx.finish(), BOUND)
        await asyncio.wait_for(rx.wait(), BOUND)
        assert torch.equal(receiver.cache.buffer[3], sender.cache.buffer[5])
    finally:
        await sender.close()


async def raw_connect(receiver: KVReceiver) -> socket.socket:
    sock = socket.socket()
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, parse_address(receiver.address))
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


# ---- accept loop -------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
async def test_accept_loop_survives_the_errors_accept_reports(transport, monkeypatch):
    """EMFILE, ENFILE, ENOBUFS (back off) and ECONNABORTED (a connection gone before it was
    taken) each end one accept, not the loop: a sender arriving afterwards is served."""
    receiver = await start_receiver(transport)
    loop = asyncio.get_running_loop()
    errors = [errno.EMFILE, errno.ENFILE, errno.ECONNABORTED, errno.ENOBUFS]
    real_accept = loop.sock_accept

    async def flaky_accept(sock):
        if errors:
            code = errors.pop(0)
            raise OSError(code, os.strerror(code))
        return await real_accept(sock)

    monkeypatch.setattr(loop, "sock_accept", flaky_accept)
    try:
        await transfer_completes(receiver)
        assert not errors
        assert not failed_listeners()
    finally:
        monkeypatch.undo()
        await receiver.close()


async def full_descriptor_table() -> None:
    """A real EMFILE: the process's descriptor limit is lowered until accept cannot get one,
    held there while the loop fails at least twice, then raised; the pending connection and a
    genuine sender are then served."""
    receiver = await start_receiver("tcp", **PATIENT)
    listener = receiver._listener._listener
    # Connected (the kernel queues it) before the limit drops, without yielding to the event loop:
    # the listener's accept of it is what meets the full table.
    waiting = socket.create_connection(parse_address(receiver.address))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    probe = os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor number
    os.close(probe)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (probe, hard))
        await wait_until(lambda: listener.accept_errors["EMFILE"] >= 2, BOUND, "two failed accepts")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        await wait_until(lambda: len(listener.preauth) == 1, BOUND, "the waiting connection accepted")
        await transfer_completes(receiver)
        assert not failed_listeners()
    finally:
        waiting.close()
        await receiver.close()


async def test_accept_loop_survives_a_full_descriptor_table():
    """In a process of its own, on this test's kind of event loop: a descriptor limit lowered
    under the UCX threads other tests leave behind would break them."""
    import uvloop

    loop = "uvloop" if isinstance(asyncio.get_running_loop(), uvloop.Loop) else "asyncio"
    root = Path(__file__).resolve().parents[2]
    proc = await SpawnedProcess.start([sys.executable, __file__, loop], cwd=str(root), merge_stderr=True,
                                      env={**os.environ, "PYTHONPATH": str(root)})
    try:
        output = await proc.read_all(4 * BOUND)
        returncode = await proc.wait(4 * BOUND)
    finally:
        await proc.kill()
    assert returncode == 0, output.decode()


async def test_an_accept_loop_that_ended_is_reported_until_its_listener_closes(monkeypatch):
    """EBADF says the listening socket itself is broken: the loop ends, and says so."""
    loop = asyncio.get_running_loop()

    async def broken_accept(sock):
        raise OSError(errno.EBADF, "the listening socket is gone")

    monkeypatch.setattr(loop, "sock_accept", broken_accept)
    receiver = await start_receiver("tcp")
    try:
        listener = receiver._listener._listener
        await asyncio.gather(listener._task, return_exceptions=True)
        assert [receiver.address in entry for entry in failed_listeners()] == [True]
    finally:
        monkeypatch.undo()
        await receiver.close()
    assert not failed_listeners(), "a listener closed on purpose is not a failure"


# ---- before authentication ---------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
async def test_unauthenticated_connections_beyond_the_bound_close_the_oldest(transport):
    bound, extra = 4, 3
    receiver = await start_receiver(transport, max_handshakes=bound, **PATIENT)
    listener = receiver._listener._listener
    socks = []
    try:
        for _ in range(bound + extra):  # one at a time, so they are accepted in this order
            socks.append(await raw_connect(receiver))
            await wait_until(lambda: len(listener.preauth) == min(len(socks), bound), BOUND, "accepted")
        await wait_until(lambda: all(closed_by_peer(s) for s in socks[:extra]), BOUND, "the oldest closed")
        assert not any(closed_by_peer(s) for s in socks[extra:]), "a newer connection was closed"
        assert len(listener.preauth) == bound and listener.preauth.evicted == extra
        await transfer_completes(receiver)  # a genuine sender still gets in (pushing one more out)
    finally:
        for sock in socks:
            sock.close()
        await receiver.close()


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
async def test_a_big_header_before_authentication_is_refused_unread(transport, monkeypatch):
    """A frame announcing a 60 000-byte header (under the 64 KiB limit for authenticated peers),
    sent whole: the receiver closes the connection having read or buffered no more than the
    pre-authentication bound (TCP: the largest read it asked for; UCX: its control buffer)."""
    largest = [0]
    if transport == "tcp":
        real = TcpChannel._recv_exact

        async def recv_exact(self, view, *args, **kwargs):
            largest[0] = max(largest[0], len(view))
            return await real(self, view, *args, **kwargs)

        monkeypatch.setattr(TcpChannel, "_recv_exact", recv_exact)
        frame = struct.pack("!I", 60_000) + bytes(60_000)
    else:
        from kvtransfer.ucx_control import ControlConnection

        real = ControlConnection._on_readable

        def on_readable(self):
            real(self)
            largest[0] = max(largest[0], len(self._buf))

        monkeypatch.setattr(ControlConnection, "_on_readable", on_readable)
        frame = struct.pack("!IQ", 60_000, 0) + bytes(60_000)
    receiver = await start_receiver(transport, **PATIENT)
    sock = await raw_connect(receiver)
    try:
        await asyncio.get_running_loop().sock_sendall(sock, frame)
        await wait_until(lambda: closed_by_peer(sock), BOUND, "the connection closed")
        assert 0 < largest[0] <= PREAUTH_MAX_HEADER_BYTES + 12, largest[0]
        monkeypatch.undo()
        await transfer_completes(receiver)
    finally:
        sock.close()
        await receiver.close()


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
async def test_strangers_connections_are_counted_and_logged_once_a_period(transport, caplog):
    """Strangers connect and leave, or send garbage: each is counted; the log gets one warning for
    all of them (a line a connection before), and a genuine sender still gets in."""
    receiver = await start_receiver(transport)
    strangers = 12
    try:
        with caplog.at_level("DEBUG", logger="kvtransfer.receiver"):
            for i in range(strangers):
                sock = await raw_connect(receiver)
                if i % 2:
                    await asyncio.get_running_loop().sock_sendall(sock, b"GET / HTTP/1.1\r\n\r\n" * 4)
                sock.close()
            await wait_until(lambda: receiver.unauthenticated_ended == strangers, BOUND, "every stranger counted")
        warnings = [r for r in caplog.records if r.name == "kvtransfer.receiver" and r.levelno >= 30]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        await transfer_completes(receiver)
        assert receiver.unauthenticated_ended == strangers
    finally:
        await receiver.close()


if __name__ == "__main__":  # test_accept_loop_survives_a_full_descriptor_table's own process
    import uvloop

    factory = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}[sys.argv[1]]
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(full_descriptor_table())
