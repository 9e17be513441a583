"""Errors of the KV-transfer layer.

Every failure of one transfer is a ``TransferError``; the engine frees (receiver) or unpins (sender)
the transfer's blocks when it sees one. ``ConnectionLost`` and ``ProtocolError`` are
connection-level: they end every transfer bound to that connection and nothing else.
"""
from __future__ import annotations


class TransferError(Exception):
    """One transfer failed; its blocks must be released by the caller."""


class TransferTimeout(TransferError):
    """The transfer (receiver) or its acknowledgement (sender lease) did not arrive in time."""


class TransferAborted(TransferError):
    """Aborted locally or by the peer; the message says which side and why."""


class PeerLost(TransferError):
    """The connection to the peer dropped while the transfer was in flight."""


class ChecksumMismatch(TransferError):
    """A block's checksum did not match its bytes (only with ``checksum=True``)."""


class HandshakeError(Exception):
    """The peers disagree on the KV layout or protocol; nothing was sent."""


class ProtocolError(Exception):
    """A peer sent a frame that violates the protocol (garbage, bad length, wrong ids)."""


class ConnectionLost(Exception):
    """The transport connection closed or broke."""
