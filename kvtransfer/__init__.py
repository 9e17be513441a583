"""KV-block shipping between prefill (sender) and decode (receiver) workers.

Decode side::

    receiver = KVReceiver(cache, config); address = await receiver.start()
    rx = receiver.expect(request_id, dst_block_ids)      # before telling the sender the ids
    result = await rx.wait()                             # TransferResult | raises TransferError

Prefill side::

    sender = KVSender(cache, config)
    tx = await sender.begin(request_id, address)
    await tx.send_blocks(src_block_ids, dst_block_ids)   # once per finished prefill chunk
    await tx.finish({"note": "any small JSON"})           # waits for the receiver's ack (lease)
"""
from kvtransfer.config import KVTransferConfig
from kvtransfer.errors import (
    ChecksumMismatch, ConnectionLost, HandshakeError, PeerLost, ProtocolError, TransferAborted,
    TransferError, TransferTimeout,
)
from kvtransfer.receiver import IncomingTransfer, KVReceiver, TransferResult
from kvtransfer.sender import KVSender, OutgoingTransfer
from kvtransfer.transports import make_transport

__all__ = [
    "KVTransferConfig", "KVReceiver", "KVSender", "IncomingTransfer", "OutgoingTransfer",
    "TransferResult", "TransferError", "TransferTimeout", "TransferAborted", "PeerLost",
    "ChecksumMismatch", "HandshakeError", "ProtocolError", "ConnectionLost", "make_transport",
]
