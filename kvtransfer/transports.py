"""Which transport carries KV blocks: ``make_transport("ucx" | "tcp" | "inproc", config)``."""
from __future__ import annotations

from kvtransfer.config import KVTransferConfig
from kvtransfer.transport_base import Transport


def make_transport(name: str, config: KVTransferConfig | None = None) -> Transport:
    """The transport named ``name``, with ``config``'s timeouts (imports UCX only when asked for)."""
    config = config or KVTransferConfig(transport=name)
    if name == "tcp":
        from kvtransfer.transport_tcp import TcpTransport

        return TcpTransport(config)
    if name == "ucx":
        from kvtransfer.transport_ucx import UcxTransport

        return UcxTransport(config)
    if name == "inproc":
        from kvtransfer.transport_inproc import InProcTransport

        return InProcTransport()
    raise ValueError(f"unknown kvtransfer transport {name!r}")
