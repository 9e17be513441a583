"""The transport interface: framed headers plus raw payload regions, nothing more.

A transport moves, in order on one connection, *frames*: a header (at most ``MAX_HEADER_BYTES``
of opaque bytes) optionally followed by one payload (a byte region). It knows nothing about
transfers or blocks; the protocol above (``sender``/``receiver``) decides which payload goes
where. The receiving side reads a header, then either ``recv_payload_into`` the destination
region or ``discard_payload`` it, before reading the next header.
"""
from __future__ import annotations

import abc
import asyncio
from typing import Awaitable, Callable

import torch


class Channel(abc.ABC):
    """One connection. Sends may be called from several tasks (frames never interleave);
    receives are called from a single reader task. Every failure of the link raises
    ``ConnectionLost``; a frame that breaks the framing raises ``ProtocolError``.

    ``max_payload_nbytes``: the largest payload ``send`` takes (senders split bigger runs)."""

    max_payload_nbytes: int = 1 << 62

    @abc.abstractmethod
    async def send(self, header: bytes, payload: torch.Tensor | None = None) -> None:
        """Send a header and, right behind it, the raw bytes of ``payload`` (a contiguous
        uint8 tensor view of cache memory, sent without a copy where the transport can)."""

    @abc.abstractmethod
    async def recv_header(self) -> bytes:
        """The next header, at most ``MAX_HEADER_BYTES``."""

    @abc.abstractmethod
    async def recv_payload_into(self, region: torch.Tensor) -> None:
        """Receive the payload announced by the last header into ``region`` (uint8, exact size)."""

    @abc.abstractmethod
    async def discard_payload(self, nbytes: int) -> None:
        """Consume the payload announced by the last header without keeping it (no big buffer)."""

    async def open_data_path(self, sender: bool, timeout: float) -> None:
        """Called on both ends once the handshake has passed, before any payload. A transport
        whose payloads travel apart from the headers (UCX) sets that path up here, so nothing
        about it reaches a peer that has not authenticated."""

    def divert_payload(self) -> bool:
        """Stop landing the payload that ``recv_payload_into`` is receiving right now.

        Called from the event loop while the reader is suspended inside ``recv_payload_into``.
        True means: from this call on, not one more byte is written into the region (the rest of
        the payload is consumed and dropped, and ``recv_payload_into`` returns normally). False
        means the transport cannot promise that (the bytes move without the event loop, as with
        UCX): the caller must wait for ``recv_payload_into`` to end, or ``close()`` the channel,
        which ends it.
        """
        return False

    def still_landing(self) -> asyncio.Future | None:
        """After ``recv_payload_into`` raised: a future that ends once the transport has stopped
        writing into that region, if it had not yet (a transport whose bytes move without the event
        loop, when a sender froze mid-payload); ``None``: nothing more lands there."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Close the connection. A receive or send in progress ends at once with ``ConnectionLost``
        (on every event loop), as do later calls on either side; once a pending receive has ended,
        nothing more is written into its region -- unless ``still_landing`` says otherwise."""

    @property
    def description(self) -> str:
        """Human-readable description of what carries the bytes (logged at connect)."""
        return type(self).__name__


class Listener(abc.ABC):
    """A listening endpoint; ``address`` is ``"host:port"`` for peers to connect to."""

    address: str

    @abc.abstractmethod
    def close(self) -> None: ...


class Transport(abc.ABC):
    """Factory for channels: ``listen`` on the receiver, ``connect`` on the sender. ``close``
    releases what the transport holds beyond its channels (the UCX worker)."""

    name: str

    def close(self) -> None:
        """Release the transport's own resources; its channels and listeners are closed first."""

    @abc.abstractmethod
    async def listen(self, host: str, port: int, on_channel: Callable[[Channel], Awaitable[None]]) -> Listener:
        """Start listening; ``on_channel`` runs (as its own task) for each accepted connection."""

    @abc.abstractmethod
    async def connect(self, host: str, port: int, timeout: float) -> Channel: ...


def byte_view(region: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor region (no copy)."""
    assert region.is_contiguous(), "KV regions must be contiguous to be sent without a copy"
    return region.reshape(-1).view(torch.uint8)
