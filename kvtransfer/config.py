"""Configuration of the KV-transfer layer, validated at construction with errors naming the field."""
from __future__ import annotations

import msgspec

TRANSPORTS = ("ucx", "tcp", "inproc")


class KVTransferConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a worker ships or receives KV blocks.

    ``host``/``port`` are where a receiver listens (port 0 picks a free one). ``transfer_timeout``
    is the receiver's default deadline for a whole transfer; ``lease_timeout`` is how long a sender
    waits for the receiver's acknowledgement after ``finish`` before it gives the blocks up.
    ``abort_grace`` bounds how long a failed transfer's payload may keep landing where the
    transport cannot divert it (UCX) before the receiver closes that connection to stop it.
    ``io_timeout``: a frame that makes no progress for this long on TCP (or a UCX payload that
    does not complete in this long) means the peer is gone, and the connection is closed.
    ``max_handshakes``: connections a receiver holds that have not authenticated yet (each has
    ``connect_timeout`` to do so); a newcomer beyond that closes the oldest of them.
    """

    transport: str = "ucx"  # where ucxx is not installed the flags fall back to TCP (default_transport)
    host: str = "127.0.0.1"
    port: int = 0
    connect_timeout: float = 5.0
    transfer_timeout: float = 120.0
    lease_timeout: float = 10.0
    abort_grace: float = 5.0
    io_timeout: float = 30.0
    checksum: bool = False
    max_handshakes: int = 128

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"kvtransfer config field 'transport': {self.transport!r} is not one of {TRANSPORTS}")
        if not self.host:
            raise ValueError("kvtransfer config field 'host': must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"kvtransfer config field 'port': {self.port} is outside 0..65535")
        if self.max_handshakes < 1:
            raise ValueError(f"kvtransfer config field 'max_handshakes': must be >= 1, got {self.max_handshakes}")
        for name in ("connect_timeout", "transfer_timeout", "lease_timeout", "abort_grace", "io_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"kvtransfer config field {name!r}: must be > 0 seconds, got {value}")

    @classmethod
    def from_dict(cls, values: dict) -> "KVTransferConfig":
        """Build from plain values (CLI/env/yaml); unknown keys and wrong types name the field."""
        try:
            return msgspec.convert(values, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"kvtransfer config: {exc}") from None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``, with a clear error for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"bad kvtransfer address {address!r}; expected 'host:port'")
    return host, int(port)


KV_DEFAULTS = KVTransferConfig()  # every KV setting's default, for the flags and the launcher


def default_transport() -> str:
    """The default transport, or TCP where UCX (the ``ucx`` extra, ``ucxx``) is not installed."""
    if KV_DEFAULTS.transport == "ucx":
        try:
            import ucxx  # noqa: F401
        except Exception:
            return "tcp"
    return KV_DEFAULTS.transport
