"""Connection handshake: the sender's KV layout and protocol version must equal the receiver's.

The sender speaks first (``Hello``); the receiver answers ``Welcome`` or ``Reject`` naming every
mismatched field, then closes. No ``Blocks`` frame is sent on a connection that did not pass.
"""
from __future__ import annotations

import asyncio

from common.engine.kv_cache import KVLayout
from kvtransfer.errors import ConnectionLost, HandshakeError, ProtocolError
from kvtransfer.messages import PROTOCOL_VERSION, Hello, Reject, Welcome, decode, encode
from kvtransfer.transport_base import Channel


async def client_handshake(channel: Channel, layout: KVLayout, checksum: bool, timeout: float) -> bool:
    """Run the sender's side; returns whether per-block checksums are on for this connection."""
    try:
        await channel.send(encode(Hello(layout=layout, checksum=checksum)))
        reply = decode(await asyncio.wait_for(channel.recv_header(), timeout))
    except asyncio.TimeoutError:
        raise HandshakeError(f"no handshake reply within {timeout}s") from None
    except (ConnectionLost, ProtocolError) as exc:
        raise HandshakeError(f"handshake failed: {exc}") from None
    if isinstance(reply, Reject):
        raise HandshakeError(f"receiver rejected the connection: {reply.reason}")
    if not isinstance(reply, Welcome):
        raise HandshakeError(f"unexpected handshake reply {type(reply).__name__}")
    try:
        await channel.open_data_path(sender=True, timeout=timeout)
    except (ConnectionLost, ProtocolError) as exc:
        raise HandshakeError(f"handshake failed: {exc}") from None
    return reply.checksum


async def server_handshake(channel: Channel, layout: KVLayout, checksum: bool, timeout: float) -> bool:
    """Run the receiver's side; raises ``HandshakeError`` after telling the peer why."""
    try:
        hello = decode(await asyncio.wait_for(channel.recv_header(), timeout))
    except asyncio.TimeoutError:
        raise HandshakeError(f"no Hello within {timeout}s") from None
    if not isinstance(hello, Hello):
        raise ProtocolError(f"expected Hello, got {type(hello).__name__}")
    problems = []
    if hello.version != PROTOCOL_VERSION:
        problems.append(f"protocol version: {hello.version} != {PROTOCOL_VERSION}")
    problems += layout.mismatches(hello.layout)
    if problems:
        reason = "KV layout mismatch (receiver != sender): " + "; ".join(problems)
        await channel.send(encode(Reject(reason=reason[:1024])))
        raise HandshakeError(reason)
    use_checksum = checksum or hello.checksum
    await channel.send(encode(Welcome(checksum=use_checksum)))
    await channel.open_data_path(sender=False, timeout=timeout)
    return use_checksum
